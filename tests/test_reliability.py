"""The bad-input catalogue of docs/RELIABILITY.md: each malformed input is rejected with the documented message and
changes nothing (model parameters, optimizer state, run directory). Cases already covered elsewhere are listed in the
catalogue with their tests and are not repeated here."""

from __future__ import annotations

import hashlib
import io
import json
import re
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from omegaconf import OmegaConf

from conftest import FakeDataProto, edited, make_batch, state_hash, tiny_config
from ppo_critic import DataParallelPPOCritic, build_value_model
from ppo_critic.cli import main
from ppo_critic.run.files import LOCK_FILE
from ppo_critic.train import train
from ppo_critic.worker import CriticWorker, worker_config
from test_train import SHORT, short_config

ROOT = Path(__file__).resolve().parents[1]
CRITIC = {"ppo_mini_batch_size": 4, "ppo_micro_batch_size_per_gpu": 2}
GOOD = make_batch(8, 6, 5, seed=9)  # B=8, P=6, R=5, T=11; every row has >= 1 prompt and >= 1 response token


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def warm_critic():
    """A critic (mini-batch 4 of a batch of 8: two optimizer steps per update) with AdamW state from one update."""
    torch.manual_seed(0)
    model = build_value_model(tiny_config("qwen2"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    critic = DataParallelPPOCritic(CRITIC, model, optimizer)
    critic.update_critic(make_batch(8, 6, 5))
    return critic


def rejects(call, exc: type[Exception], message: str, *state) -> str:
    """`call()` raises `exc` whose text contains `message`, and `state` (model, optimizer) is bit-identical after."""
    before = state_hash(*state) if state else None
    with pytest.raises(exc) as info:
        call()
    assert message in str(info.value), str(info.value)
    if state:
        assert state_hash(*state) == before
    return str(info.value)


# ---------------------------------------------------------------------------------------------------------------
# Python API: batches given to compute_values / update_critic


def _batch_cases() -> dict[str, tuple]:
    g = GOOD
    r = g["responses"].shape[1]
    ids = g["input_ids"].clone()
    ids[6, 8] = -3  # sample 6: in the second mini-batch, so a late check would come after one optimizer step
    unread = g["attention_mask"].clone()
    unread[3, :6] = 0  # sample 3 loses its whole prompt
    nan_returns = g["returns"].clone()
    nan_returns[7, 0] = float("nan")  # the last sample, first response token (always valid)
    outside = int((g["attention_mask"][:, -r:] == 0).sum())
    bad_attention = g["attention_mask"].clone()
    bad_attention[0, -1] = 2
    micro0 = FakeDataProto(g, {}, {"micro_batch_size": 0})
    budget = FakeDataProto(g, {}, {"use_dynamic_bsz": True, "max_token_len": -1})
    return {
        "input_ids-uint8": (
            "update",
            edited(g, input_ids=g["input_ids"].to(torch.uint8)),
            TypeError,
            "batch['input_ids'] must be a torch.long (or torch.int32) tensor, got torch.uint8",
        ),
        "input_ids-negative": (
            "update",
            edited(g, input_ids=ids, responses=ids[:, -r:]),
            ValueError,
            "batch['input_ids'] holds 1 negative token id(s) (first at sample 6, position 8: -3); token ids "
            "(padding included) must be in [0, vocab_size)",
        ),
        "attention_mask-not-binary": (
            "update",
            edited(g, attention_mask=bad_attention),
            ValueError,
            "batch['attention_mask'] must hold only 0 and 1",
        ),
        "response_mask-not-binary": (
            "update",
            edited(g, response_mask=g["attention_mask"][:, -r:] * 0.5),
            ValueError,
            "batch['response_mask'] must hold only 0 and 1",
        ),
        "masks-disagree": (
            "update",
            edited(g, response_mask=torch.ones(8, r, dtype=torch.long)),
            ValueError,
            f"batch['response_mask'] marks {outside} token(s) as valid where attention_mask marks padding; a response "
            "token must be attended to",
        ),
        "empty-prompt": (
            "values",
            edited(g, attention_mask=unread),
            ValueError,
            "batch['attention_mask'] is 0 at position 5 of sample 3, just before its valid response token 0; a value "
            "is read at the position before each response token, so that position must be attended to (every sample "
            "needs a non-empty prompt)",
        ),
        "values-require-grad": (
            "update",
            edited(g, values=g["values"].clone().requires_grad_()),
            ValueError,
            "batch['values'] requires grad (it is attached to an autograd graph); pass values.detach()",
        ),
        "returns-integer": (
            "update",
            edited(g, returns=g["returns"].long()),
            TypeError,
            "batch['returns'] must be a floating-point tensor, got torch.int64",
        ),
        "nan-in-last-mini-batch": (
            "update",
            edited(g, returns=nan_returns),
            ValueError,
            "batch['returns'] has 1 NaN/Inf value(s) at valid response positions (first at sample 7, response token "
            "0); fix the rollout or mask those tokens",
        ),
        "multi_modal_inputs-length": (
            "update",
            {**g, "multi_modal_inputs": [{}] * 7},
            ValueError,
            "batch['multi_modal_inputs'] must hold one dict per sample (8), got 7 entries",
        ),
        "dataproto-without-tensors": (
            "update",
            FakeDataProto(None, {}, {}),
            ValueError,
            "batch is missing key(s) ['input_ids', 'attention_mask', 'position_ids', 'responses', 'values', "
            "'returns']; a rollout batch needs input_ids [B, T]",
        ),
        "meta_info-micro_batch_size-0": (
            "values",
            micro0,
            ValueError,
            "the micro-batch size (ppo_micro_batch_size_per_gpu, forward_micro_batch_size_per_gpu or "
            "meta_info['micro_batch_size']) must be a positive integer, got 0",
        ),
        "meta_info-max_token_len-negative": (
            "values",
            budget,
            ValueError,
            "the dynamic micro-batch budget (ppo_max_token_len_per_gpu, or forward_max_token_len_per_gpu / "
            "meta_info['max_token_len'] for compute_values) must be a positive integer, got -1",
        ),
    }


BATCH_CASES = _batch_cases()


@pytest.mark.parametrize("case", list(BATCH_CASES))
def test_bad_batch_is_rejected_before_anything_changes(warm_critic, case):
    call, batch, exc, message = BATCH_CASES[case]
    run = warm_critic.update_critic if call == "update" else warm_critic.compute_values
    rejects(lambda: run(batch), exc, message, warm_critic.critic_module, warm_critic.critic_optimizer)
    assert warm_critic.update_critic(GOOD)["critic/skipped_steps"] == 0  # the critic still works


# ---------------------------------------------------------------------------------------------------------------
# Python API: configs given to DataParallelPPOCritic (dict, verl section or CriticConfig)

CONFIG_CASES = {
    "unknown-key": ({"ppo_mini_batch": 4}, "unknown config key 'ppo_mini_batch'; did you mean 'ppo_mini_batch_size'?"),
    "unknown-nested-key": (
        {"model": {"use_rmpad": True}},
        "unknown config key 'model.use_rmpad'; did you mean 'model.use_remove_padding'?",
    ),
    "key-in-the-wrong-section": (
        {"use_remove_padding": True},
        "unknown config key 'use_remove_padding'; did you mean 'model.use_remove_padding'?",
    ),
    "dynamic-budget-zero": (
        {"use_dynamic_bsz": True, "ppo_max_token_len_per_gpu": 0},
        "ppo_max_token_len_per_gpu=0 must be a positive integer",
    ),
    "ulysses-without-remove-padding": (
        {"ulysses_sequence_parallel_size": 2, "model": {"use_remove_padding": False}},
        "ulysses_sequence_parallel_size > 1 needs model.use_remove_padding=true (or auto)",
    ),
    "megatron-with-ulysses": (
        {"strategy": "megatron", "ulysses_sequence_parallel_size": 2, "model": {"use_remove_padding": True}},
        "ulysses_sequence_parallel_size must be 1 with strategy=megatron (use megatron's tensor parallel)",
    ),
}


@pytest.mark.parametrize("case", list(CONFIG_CASES))
def test_bad_config_is_rejected_at_construction(warm_critic, case):
    config, message = CONFIG_CASES[case]
    model, optimizer = warm_critic.critic_module, warm_critic.critic_optimizer
    rejects(
        lambda: DataParallelPPOCritic({**CRITIC, **config}, model, optimizer), ValueError, message, model, optimizer
    )


# what a worker builds (megatron layout): checked by ppo-critic's workers, not by a critic given a built model
WORKER_CASES = {
    "megatron-context-parallel": (
        {"strategy": "megatron", "megatron": {"context_parallel_size": 2}},
        "megatron.context_parallel_size must be 1 (context parallelism needs transformer-engine)",
    ),
    "megatron-sequence-parallel": (
        {"strategy": "megatron", "megatron": {"tensor_model_parallel_size": 2, "sequence_parallel": True}},
        "megatron.sequence_parallel=true is not supported (it needs transformer-engine); set false",
    ),
    "megatron-virtual-pipeline-without-pipeline": (
        {"strategy": "megatron", "megatron": {"virtual_pipeline_model_parallel_size": 2}},
        "megatron.virtual_pipeline_model_parallel_size=2 needs pipeline_model_parallel_size",
    ),
    "megatron-tensor-parallel-zero": (
        {"strategy": "megatron", "megatron": {"tensor_model_parallel_size": 0}},
        "megatron.tensor_model_parallel_size=0 must be a positive integer",
    ),
}


@pytest.mark.parametrize("case", list(WORKER_CASES))
def test_bad_layout_is_rejected_by_the_worker(case):
    config, message = WORKER_CASES[case]
    with pytest.raises(ValueError, match=re.escape(message)):
        worker_config({**CRITIC, **config})


def fresh_critic_parts(tiny_qwen2):
    model = tiny_qwen2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    DataParallelPPOCritic(CRITIC, model, optimizer).update_critic(GOOD)
    return model, optimizer


ULYSSES = {**CRITIC, "ulysses_sequence_parallel_size": 2, "model": {"use_remove_padding": True}}


def test_ulysses_without_enough_processes(tiny_qwen2):
    model, optimizer = fresh_critic_parts(tiny_qwen2)
    message = "ulysses_sequence_parallel_size=2 needs 2 processes per sequence; launch with torchrun"
    rejects(lambda: DataParallelPPOCritic(ULYSSES, model, optimizer), ValueError, message, model, optimizer)


def test_ulysses_size_not_dividing_the_world(tiny_qwen2):
    """Under a process group (here a single-process gloo group) the world must be a multiple of the sp size."""
    import torch.distributed as dist

    model, optimizer = fresh_critic_parts(tiny_qwen2)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        message = "world size 1 is not divisible by ulysses_sequence_parallel_size=2"
        rejects(lambda: DataParallelPPOCritic(ULYSSES, model, optimizer), ValueError, message, model, optimizer)
    finally:
        dist.destroy_process_group()


def test_rejected_ulysses_config_leaves_the_model_attention_alone(tiny_qwen2):
    model, optimizer = fresh_critic_parts(tiny_qwen2)
    before = model.config._attn_implementation
    with pytest.raises(ValueError, match="needs 2 processes per sequence"):
        DataParallelPPOCritic(ULYSSES, model, optimizer)
    assert model.config._attn_implementation == before
    DataParallelPPOCritic(CRITIC, model, optimizer).compute_values(GOOD)  # the model still works


def test_token_id_beyond_the_vocabulary_is_rejected_before_any_step(warm_critic):
    ids = GOOD["input_ids"].clone()
    ids[6, 8] = warm_critic.critic_module.config.vocab_size
    batch = edited(GOOD, input_ids=ids, responses=ids[:, -5:])
    model, optimizer = warm_critic.critic_module, warm_critic.critic_optimizer
    rejects(lambda: warm_critic.update_critic(batch), ValueError, "input_ids", model, optimizer)


# ---------------------------------------------------------------------------------------------------------------
# Python API: building the value model (nothing exists yet, so nothing may be left behind)


def test_missing_model_path(tmp_path):
    missing = tmp_path / "no-such-model"
    message = f"model path '{missing}' does not exist, nor is it a model id in the Hugging Face cache"
    rejects(lambda: CriticWorker({**CRITIC, "model": {"path": str(missing)}}), FileNotFoundError, message)
    assert not missing.exists() and list(tmp_path.iterdir()) == []


def test_model_directory_without_a_config(tmp_path):
    (tmp_path / "model").mkdir()
    message = f"model path '{tmp_path / 'model'}' holds no config.json"
    rejects(lambda: build_value_model(tmp_path / "model"), FileNotFoundError, message)
    assert list((tmp_path / "model").iterdir()) == []


def test_token_classification_head_for_an_architecture_without_one():
    message = (
        "model_type 'olmo2' has no *ForTokenClassification in the installed transformers; use head='generic' "
        "(or 'auto')"
    )
    rejects(lambda: build_value_model(tiny_config("olmo2"), head="token_classification"), ValueError, message)


# ---------------------------------------------------------------------------------------------------------------
# The CLI: a bad command exits with code 2 and a message, and leaves the run directory as it was


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """A finished short run (checkpoints at steps 2 and 4, metrics, hf export) to point bad commands at."""
    run = tmp_path_factory.mktemp("trained") / "run"
    train(short_config(run, "trainer.logger=[console,jsonl]"), out=io.StringIO())
    return run


def digest(run: Path, config: bool = True) -> dict[str, str]:
    """Every file of a run directory (optionally without config.yaml) → its sha256; the lock file, which names
    whichever command last held the directory, is not the run's content."""
    kept = (p for p in sorted(run.rglob("*")) if p.is_file() and p.name != LOCK_FILE)
    files = (p for p in kept if config or p.name != "config.yaml")
    return {str(p.relative_to(run)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def run_cli(argv: list[str], capsys) -> tuple[int, str]:
    try:
        code = main(argv)
    except SystemExit as exit_:
        code = exit_.code
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


ROW = {"prompt_ids": [1, 2], "response_ids": [3, 4], "reward": 1.0}


def _cli_cases(run: Path, tmp: Path) -> dict[str, tuple[list[str], str, bool]]:
    """case → (argv, message, whether config.yaml must stay as it was too)."""
    short = [*SHORT, f"trainer.run_dir={run}", "trainer.logger=[console,jsonl]"]
    (tmp / "not-a-checkpoint").mkdir()
    wide = write_rows(tmp / "wide.jsonl", [{**ROW, "prompt_ids": [19, 2]}])
    huge = write_rows(tmp / "huge.jsonl", [ROW, {**ROW, "prompt_ids": [2**64]}])
    parquet = tmp / "typed.parquet"
    pq.write_table(pa.table({"prompt_ids": ["1 2"], "response_ids": [[3]], "reward": [1.0]}), parquet)
    (tmp / "empty.jsonl").write_text("\n\n")
    (tmp / "rollouts.csv").write_text("prompt_ids,response_ids\n")
    vocab = OmegaConf.load(run / "config.yaml").critic.model.override_config.vocab_size
    beyond = write_rows(tmp / "beyond.jsonl", [ROW, {**ROW, "response_ids": [vocab]}])
    out = tmp / "values.jsonl"
    return {
        "resume-from-a-directory-that-is-not-a-checkpoint": (
            ["train", *short, f"trainer.resume={tmp / 'not-a-checkpoint'}"],
            f"{tmp / 'not-a-checkpoint'} is not a complete checkpoint (missing .metadata or trainer_state.json)",
            False,
        ),
        "resume-with-another-model-config": (
            ["train", *short, "critic.model.override_config.hidden_size=16"],
            f"these options differ from the run being resumed in {run} (saved -> now): "
            "critic.model.override_config: {'model_type': 'qwen2', 'hidden_size': 32,",
            False,
        ),
        "config-file-missing": (
            ["train", "--config", str(tmp / "missing.yaml"), f"trainer.run_dir={run}"],
            f"config file {tmp / 'missing.yaml'} does not exist",
            True,
        ),
        "contradicting-batch-sizes": (
            ["train", *short, "critic.ppo_micro_batch_size_per_gpu=3"],
            "critic.ppo_mini_batch_size=4 is not divisible by the micro-batch size 3 (ppo_micro_batch_size_per_gpu); "
            "choose a divisor, or set use_dynamic_bsz=true",
            True,
        ),
        "ulysses-in-one-process": (
            ["train", *short, "critic.ulysses_sequence_parallel_size=2", "critic.model.use_remove_padding=true"],
            "ulysses_sequence_parallel_size=2 needs 2 processes per sequence; launch with torchrun",
            True,
        ),
        "model-path-missing": (
            ["train", *short, f"critic.model.path={tmp / 'no-model'}"],
            f"model path '{tmp / 'no-model'}' does not exist, nor is it a model id in the Hugging Face cache",
            True,
        ),
        "rollout-file-missing": (
            ["train", *short, f"data={tmp / 'missing.jsonl'}"],
            f"[Errno 2] rollout file not found: '{tmp / 'missing.jsonl'}'",
            True,
        ),
        "rollout-file-empty": (
            ["train", *short, f"data={tmp / 'empty.jsonl'}"],
            f"{tmp / 'empty.jsonl'}: no rollout rows found (the file is empty or holds only blank lines)",
            True,
        ),
        "rollout-file-extension": (
            ["train", *short, f"data={tmp / 'rollouts.csv'}"],
            f"{tmp / 'rollouts.csv'}: unsupported file extension '.csv'; supported: .jsonl, .parquet",
            True,
        ),
        "rollout-token-id-beyond-int64": (
            ["train", *short, f"data={huge}"],
            f"{huge}: row 2: field 'prompt_ids' must hold token ids in [0, 2**63), got {2**64} at element 0",
            True,
        ),
        "rollout-parquet-column-type": (
            ["train", *short, f"data={parquet}"],
            f"{parquet}: column 'prompt_ids' must have Parquet/Arrow type list<integer>, got string",
            True,
        ),
        "rollout-vocabulary-beyond-the-model": (
            ["train", *short, f"data={wide}", "trainer.eval_fraction=0", "critic.model.override_config.vocab_size=8"],
            "critic.model.override_config.vocab_size=8 is smaller than the rollouts' vocabulary (20 token ids)",
            True,
        ),
        "values-token-id-beyond-the-vocabulary": (
            ["values", str(run), f"data={beyond}", f"out={out}"],
            f"{beyond}: row 2: field 'response_ids' must hold token ids in [0, vocab_size={vocab}), got {vocab} at "
            "element 0",
            True,
        ),
    }


CLI_CASE_NAMES = [
    "resume-from-a-directory-that-is-not-a-checkpoint",
    "resume-with-another-model-config",
    "config-file-missing",
    "contradicting-batch-sizes",
    "ulysses-in-one-process",
    "model-path-missing",
    "rollout-file-missing",
    "rollout-file-empty",
    "rollout-file-extension",
    "rollout-token-id-beyond-int64",
    "rollout-parquet-column-type",
    "rollout-vocabulary-beyond-the-model",
    "values-token-id-beyond-the-vocabulary",
]


@pytest.fixture
def run_copy(trained_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    return run


@pytest.mark.parametrize("case", CLI_CASE_NAMES)
def test_bad_command_exits_2_and_leaves_the_run_directory_alone(run_copy, tmp_path, capsys, case):
    cases = _cli_cases(run_copy, tmp_path)
    assert list(cases) == CLI_CASE_NAMES
    argv, message, config_kept = cases[case]
    before = digest(run_copy, config=config_kept)
    code, text = run_cli(argv, capsys)
    assert code == 2, text
    assert message in text, text
    assert digest(run_copy, config=config_kept) == before  # checkpoints, metrics, export: all untouched
    assert not (tmp_path / "values.jsonl").exists()


def test_failed_resume_keeps_config_yaml(run_copy, capsys):
    before = digest(run_copy)
    argv = ["train", *SHORT, f"trainer.run_dir={run_copy}", "critic.model.override_config.hidden_size=16"]
    assert run_cli(argv, capsys)[0] == 2
    assert digest(run_copy) == before


def test_export_without_a_checkpoint(run_copy, tmp_path, capsys):
    shutil.rmtree(run_copy / "checkpoints")
    before = digest(run_copy)
    code, text = run_cli(["export", str(run_copy), str(tmp_path / "exported")], capsys)
    assert code == 2
    assert f"{run_copy} has no complete checkpoint under checkpoints/" in text
    assert digest(run_copy) == before and not (tmp_path / "exported").exists()


# ---------------------------------------------------------------------------------------------------------------
# The catalogue itself: every test it names exists, and it has at least 25 rows

CATALOGUE = ROOT / "docs" / "RELIABILITY.md"


def catalogue_rows() -> list[list[str]]:
    rows = []
    for line in CATALOGUE.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) >= 4 and cells[0].isdigit():
            rows.append(cells)
    return rows


def test_the_catalogue_names_tests_that_exist():
    rows = catalogue_rows()
    assert len(rows) >= 25
    assert [int(r[0]) for r in rows] == list(range(1, len(rows) + 1))
    for row in rows:
        refs = re.findall(r"`(tests/[\w/]+\.py)::(\w+)(?:\[([^\]]+)\])?`", row[-1])
        assert refs, row
        for path, name, param in refs:
            source = (ROOT / path).read_text()
            assert re.search(rf"^def {name}\(", source, re.M), (path, name)
            if param and not re.fullmatch(r"[a-z_]+\d+(-[a-z_]+\d+)*", param):  # not one of pytest's generated ids
                assert f'"{param}"' in source, (path, param)
