"""Shared fixtures: tiny fp32 value models and rollout batches in the layout of DESIGN §3."""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

# the verl suites need verl in an environment of their own: tests/with_verl/run.sh builds it and sets this variable
collect_ignore = [] if os.environ.get("PPO_CRITIC_VERL_SUITE") else ["with_verl"]

# tests mirror the package's folders; a test module imports another's helpers by its unique name
# (`from test_packing import critic_pair`), wherever either lives, also when one file runs alone
_HERE = Path(__file__).resolve().parent
sys.path[1:1] = [
    str(d) for d in sorted(_HERE.iterdir()) if d.is_dir() and any(d.glob("test_*.py")) and str(d) not in sys.path
]

TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 128,
    "max_position_embeddings": 256,
}

# Tolerances of float32 comparisons between two computations of the same math whose only difference is the order of
# their sums (packed vs padded rows, other micro-batches, dynamic batching, DP/SP layouts, an export reloaded).
# With u = 2**-24, two orders of one float32 sum of n terms differ by at most ~2·n·u·Σ|terms| (Higham, "Accuracy and
# Stability of Numerical Algorithms", §3.1), and by ~√n·u·Σ|terms| when roundings are independent (Higham & Mary,
# "A new approach to probabilistic rounding error analysis", 2019). TINY sums n <= 128 terms per dot product (hidden
# 64, MLP 128, <= 64 attention positions): 1.5e-5 worst case, ~7e-7 typically, relative to magnitudes that RMSNorm
# keeps O(1) through the 2 layers. So values of magnitude <= ~1 differ by ~1e-6 (measured: <= 4e-7) and 1e-5 holds
# on any IEEE-754 CPU with a factor ~10 to spare, while a real bug (a wrong position, mask or normaliser) moves values
# by 1e-3 or more. DESIGN §6 sets the same 1e-5 for the distributed layout-invariance suite.
FP32_REORDERED = {"rtol": 1e-5, "atol": 1e-5}


def pytest_collection_modifyitems(config, items):
    """Tests marked `cuda` are skipped on a machine without CUDA (and `-m cuda` selects exactly them on a GPU)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def no_leaked_process_group():
    """A test that leaves a default process group behind makes every later single-process test see a world of one
    under FSDP; fail the test that leaked it (and clean up) instead of the innocent ones after it. A group a
    session-scoped fixture set up before the test (the verl suites' `single_process`) is not the test's to end."""
    import torch.distributed as dist

    before = dist.is_available() and dist.is_initialized()
    yield
    if not before and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        pytest.fail("the test left a torch.distributed process group initialised")


@pytest.fixture
def one_process_group():
    """A one-rank gloo group for the test (torch.distributed's collectives, FSDP, DDP in this process)."""
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models gain nothing from intra-op threads, and on a busy 2-core machine spinning OpenMP threads make a
    module many times slower; the previous setting is restored afterwards."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def tiny_config(model_type: str = "qwen2", **overrides) -> dict:
    return {"model_type": model_type, **TINY, **overrides}


def make_batch(
    batch_size: int = 8, prompt_len: int = 6, response_len: int = 5, seed: int = 0, vocab: int = 128
) -> dict[str, torch.Tensor]:
    """Left-padded prompts and right-padded responses of varied lengths (every row has >= 1 response token)."""
    g = torch.Generator().manual_seed(seed)
    t = prompt_len + response_len
    input_ids = torch.randint(0, vocab, (batch_size, t), generator=g)
    attention_mask = torch.ones(batch_size, t, dtype=torch.long)
    for i in range(batch_size):
        pad_left = int(torch.randint(0, prompt_len, (1,), generator=g))
        resp = int(torch.randint(1, response_len + 1, (1,), generator=g))
        attention_mask[i, :pad_left] = 0
        attention_mask[i, prompt_len + resp :] = 0
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        "responses": input_ids[:, -response_len:],
        "values": torch.randn(batch_size, response_len, generator=g) * 0.5,
        "returns": torch.randn(batch_size, response_len, generator=g),
    }


def exported_values(out_dir, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """What an HF token-classification export gives for `batch`, in `compute_values`' layout: the logit at the
    position before each response token, 0 at padding."""
    from transformers import AutoModelForTokenClassification

    hf = AutoModelForTokenClassification.from_pretrained(out_dir)
    out = hf(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"])
    r = batch["responses"].shape[1]
    return torch.where(batch["attention_mask"][:, -r:].bool(), out.logits.squeeze(-1)[:, -r - 1 : -1], 0.0)


TIMINGS = ("time", "elapsed_s")


def without_timings(row: dict) -> dict:
    """A metrics row without what depends on the clock (throughput, time stamps), for comparing two runs."""
    return {k: v for k, v in row.items() if not k.startswith("perf/") and k not in TIMINGS}


def edited(tensors: dict, **changes) -> dict:
    """A copy of `tensors` with keys replaced (a value of None removes the key)."""
    out = dict(tensors)
    for key, value in changes.items():
        if value is None:
            out.pop(key)
        else:
            out[key] = value
    return out


class FakeDataProto:
    """The attributes of verl's DataProto that `Batch.from_any` relies on."""

    def __init__(self, batch, non_tensor_batch, meta_info):
        self.batch = batch
        self.non_tensor_batch = non_tensor_batch
        self.meta_info = meta_info


def state_hash(module: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> str:
    """A digest of parameters and optimizer state: equal digests mean nothing changed."""
    h = hashlib.sha256()
    for name, p in module.state_dict().items():
        h.update(name.encode())
        h.update(p.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    if optimizer is not None:
        for state in optimizer.state.values():
            for key, value in sorted(state.items()):
                h.update(key.encode())
                if isinstance(value, torch.Tensor):
                    h.update(value.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
                else:
                    h.update(repr(value).encode())
    return h.hexdigest()


@pytest.fixture(scope="session")
def tiny_qwen2():
    """A factory of identical tiny Qwen2 value models (same seed → same weights)."""
    from ppo_critic import build_value_model

    def build(seed: int = 0, **kwargs):
        torch.manual_seed(seed)
        return build_value_model(tiny_config("qwen2"), **kwargs)

    return build


def bench_script(relative: str):
    """A script of bench/ (`"ablation.py"`, `"gpu/harness.py"`) freshly imported as a module named after its file
    (registered in sys.modules: its dataclasses look their module up there)."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "bench" / relative
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return module
