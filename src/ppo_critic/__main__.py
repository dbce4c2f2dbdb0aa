"""`python -m ppo_critic` is the `ppo-critic` command."""

import sys

from ppo_critic.cli import main

sys.exit(main())
