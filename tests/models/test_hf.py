"""build_value_model: token-classification, generic backbone + head, TRL-style v_head; head init and dtype."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch import nn

from conftest import make_batch, tiny_config
from ppo_critic import DataParallelPPOCritic, build_value_model
from ppo_critic.models.hf import ValueHead, ValueModel, find_value_head


class TrlValueHead(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.dropout = nn.Dropout(0.1)
        self.summary = nn.Linear(hidden, 1)

    def forward(self, hidden):
        return self.summary(self.dropout(hidden))


class TrlStyleCritic(nn.Module):
    """The surface of TRL's AutoModelForCausalLMWithValueHead: returns (lm_logits, loss, values)."""

    def __init__(self):
        super().__init__()
        from transformers import AutoConfig, AutoModelForCausalLM

        fields = tiny_config("llama")
        config = AutoConfig.for_model(fields.pop("model_type"), **fields)
        self.pretrained_model = AutoModelForCausalLM.from_config(config)
        self.v_head = TrlValueHead(config.hidden_size)

    def forward(self, input_ids, attention_mask, position_ids, use_cache, **kwargs):
        out = self.pretrained_model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=use_cache,
            output_hidden_states=True,
            **kwargs,
        )
        return out.logits, None, self.v_head(out.hidden_states[-1]).squeeze(-1)


def train_twenty_steps(model):
    batch = make_batch(8, 6, 5, seed=21)
    critic = DataParallelPPOCritic(
        {"ppo_mini_batch_size": 8, "ppo_micro_batch_size_per_gpu": 4, "cliprange_value": None},
        model,
        torch.optim.AdamW(model.parameters(), lr=3e-3),
    )
    values = critic.compute_values(batch)
    losses = [critic.update_critic(batch)["critic/vf_loss"] for _ in range(20)]
    return values, losses


@pytest.mark.parametrize(
    ("source", "expected_type"),
    [
        (lambda: build_value_model(tiny_config("qwen2")), "Qwen2ForTokenClassification"),
        (lambda: build_value_model(tiny_config("llama")), "LlamaForTokenClassification"),
        (lambda: build_value_model(tiny_config("olmo2")), "ValueModel"),  # no Olmo2ForTokenClassification
        (lambda: build_value_model(TrlStyleCritic()), "TrlStyleCritic"),
    ],
    ids=["qwen2", "llama", "olmo2-generic", "trl-v_head"],
)
def test_every_kind_of_value_model_gives_values_and_trains(source, expected_type):
    torch.manual_seed(0)
    model = source()
    assert type(model).__name__ == expected_type
    values, losses = train_twenty_steps(model)
    assert values.shape == (8, 5)
    assert losses[-1] < 0.5 * losses[0], losses


def test_generic_head_is_available_for_every_architecture():
    model = build_value_model(tiny_config("qwen2"), head="generic")
    assert isinstance(model, ValueModel) and isinstance(model.score, ValueHead)
    with pytest.raises(ValueError, match=r"olmo2.*ForTokenClassification"):
        build_value_model(tiny_config("olmo2"), head="token_classification")


@pytest.mark.parametrize("head", ["auto", "generic"])
def test_value_head_init(head):
    torch.manual_seed(0)
    zero = build_value_model(tiny_config("qwen2"), head=head, value_head_init="zero")
    parent, name = find_value_head(zero)
    assert getattr(parent, name).weight.abs().sum() == 0
    critic = DataParallelPPOCritic({"ppo_mini_batch_size": 8}, zero, torch.optim.SGD(zero.parameters(), lr=0.1))
    assert critic.compute_values(make_batch()).abs().sum() == 0
    normal = build_value_model(tiny_config("qwen2", hidden_size=256), head=head, value_head_init="normal:0.5")
    parent, name = find_value_head(normal)
    weight = getattr(parent, name).weight
    assert 0.4 < weight.std().item() < 0.6
    assert getattr(parent, name).bias is None or getattr(parent, name).bias.abs().sum() == 0


def test_head_dropout_is_zero_and_cache_is_off():
    for model in (build_value_model(tiny_config("qwen2")), build_value_model(TrlStyleCritic())):
        parent, _ = find_value_head(model)
        dropouts = [m for m in (*model.children(), *parent.children()) if isinstance(m, nn.Dropout)]
        assert dropouts and all(m.p == 0 for m in dropouts)
    config = build_value_model(tiny_config("qwen2")).config
    assert config.num_labels == 1 and config.classifier_dropout == 0 and config.use_cache is False


@pytest.mark.parametrize("head", ["auto", "generic"])
def test_fp32_value_head_under_bf16(head):
    model = build_value_model(tiny_config("qwen2"), head=head, dtype="bfloat16", value_head_dtype="float32")
    parent, name = find_value_head(model)
    linear = getattr(parent, name)
    assert isinstance(linear, ValueHead) and linear.weight.dtype == torch.float32
    assert next(model.parameters()).dtype == torch.bfloat16
    batch = make_batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False)
    assert out.logits.dtype == torch.float32
    assert set(model.state_dict()) >= {f"{name}.weight"} or head == "generic"


def test_local_path_loads_weights_and_keeps_a_trained_head(tmp_path):
    torch.manual_seed(0)
    original = build_value_model(tiny_config("qwen2"), value_head_init="normal:0.3")
    original.save_pretrained(tmp_path / "critic")
    loaded = build_value_model(tmp_path / "critic", value_head_init="zero")  # the saved head wins
    batch = make_batch()
    opt = torch.optim.SGD(original.parameters(), lr=0.1)
    a = DataParallelPPOCritic({"ppo_mini_batch_size": 8}, original, opt).compute_values(batch)
    b = DataParallelPPOCritic({"ppo_mini_batch_size": 8}, loaded, opt).compute_values(batch)
    torch.testing.assert_close(a, b, rtol=0, atol=0)  # exact: float32 weights saved and loaded bit for bit, same code
    assert a.abs().sum() > 0


def test_local_causal_lm_checkpoint_gets_a_fresh_head(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = tiny_config("qwen2")
    lm = AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg.pop("model_type"), **cfg))
    lm.save_pretrained(tmp_path / "lm")
    model = build_value_model(str(tmp_path / "lm"), value_head_init="zero")
    torch.testing.assert_close(
        model.model.embed_tokens.weight, lm.model.embed_tokens.weight, rtol=0, atol=0
    )  # the backbone was loaded (exactly), not re-initialised
    assert model.score.weight.abs().sum() == 0


def test_a_head_we_initialise_or_load_raises_no_load_report(tmp_path, capfd):
    """transformers' load report called the head MISSING ("newly initialized") and lm_head UNEXPECTED in every
    `ppo-critic values` / `export` of a run built from a language model, for a head the critic then loads."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = tiny_config("qwen2")
    AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg.pop("model_type"), **cfg)).save_pretrained(tmp_path)
    capfd.readouterr()
    build_value_model(str(tmp_path))
    err = capfd.readouterr().err
    assert (
        "MISSING" not in err and "LOAD REPORT" not in err and "not sharded" not in err and "Loading weights" not in err
    )


def test_a_checkpoint_without_backbone_weights_is_refused(tmp_path):
    """A backbone weight the checkpoint lacks would be randomly initialised: values of an untrained layer."""
    from safetensors.torch import load_file, save_file

    build_value_model(tiny_config("qwen2")).save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    save_file({k: v for k, v in weights.items() if "layers.1.mlp" not in k}, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"lacks weights of the model's backbone \(model\.layers\.1\.mlp\.down_proj"):
        build_value_model(str(tmp_path))


def test_bad_sources_are_named():
    with pytest.raises(FileNotFoundError, match="does-not-exist"):
        build_value_model("/tmp/does-not-exist/critic")
    with pytest.raises(ValueError, match="model_type"):
        build_value_model({"hidden_size": 64})
    with pytest.raises(TypeError, match="v_head"):
        build_value_model(nn.Linear(4, 1))
    with pytest.raises(ValueError, match="value_head_init"):
        build_value_model(tiny_config("qwen2"), value_head_init="uniform")
    with pytest.raises(ValueError, match="value_head_dtype"):
        build_value_model(tiny_config("qwen2"), value_head_dtype="float8")


# --- value_head_init=from_reward_model:<dir> ---


def _padded_ids(batch, pad_id=0):
    """Token ids with the pad id at padding and nowhere else, so a sequence-classification model can find the
    last token of each row (`input_ids != pad_id`)."""
    ids = batch["input_ids"].clamp(min=1)
    return torch.where(batch["attention_mask"].bool(), ids, pad_id)


def _last_token_scores(critic, batch, ids):
    out = critic(input_ids=ids, attention_mask=batch["attention_mask"], position_ids=batch["position_ids"])
    last = batch["attention_mask"].shape[1] - 1 - batch["attention_mask"].flip(-1).argmax(-1)  # right padding
    return out.logits.squeeze(-1)[torch.arange(len(ids)), last]


@pytest.mark.parametrize("head", ["auto", "generic"])
def test_reward_model_critic_reproduces_the_sequence_classifier_score_exactly(tmp_path, head):
    from transformers import AutoConfig, AutoModelForSequenceClassification

    fields = tiny_config("qwen2")
    config = AutoConfig.for_model(fields.pop("model_type"), **fields, num_labels=1, pad_token_id=0)
    torch.manual_seed(3)
    rm = AutoModelForSequenceClassification.from_config(config).eval()
    torch.nn.init.normal_(rm.score.weight, std=0.5)
    rm.save_pretrained(tmp_path / "rm")
    critic = build_value_model(tiny_config("qwen2"), head=head, value_head_init=f"from_reward_model:{tmp_path / 'rm'}")
    batch = make_batch(8, 6, 5, seed=2)
    ids = _padded_ids(batch)
    with torch.no_grad():
        expected = rm(input_ids=ids, attention_mask=batch["attention_mask"], position_ids=batch["position_ids"])
        got = _last_token_scores(critic.eval(), batch, ids)
    assert torch.equal(got, expected.logits.squeeze(-1))
    assert expected.logits.std() > 0.1  # a real score, not a constant


def test_reward_model_with_a_trl_value_head(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = tiny_config("qwen2")
    torch.manual_seed(4)
    lm = AutoModelForCausalLM.from_config(AutoConfig.for_model(fields.pop("model_type"), **fields)).eval()
    v_head = nn.Linear(lm.config.hidden_size, 1)
    state = {**lm.state_dict(), "v_head.summary.weight": v_head.weight.data, "v_head.summary.bias": v_head.bias.data}
    lm.save_pretrained(tmp_path / "trl", state_dict=state)
    critic = build_value_model(tiny_config("qwen2"), value_head_init=f"from_reward_model:{tmp_path / 'trl'}").eval()
    batch = make_batch(8, 6, 5, seed=5)
    with torch.no_grad():
        hidden = lm.model(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"]
        ).last_hidden_state
        expected = v_head(hidden).squeeze(-1)
        out = critic(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"]
        )
    mask = batch["attention_mask"].bool()
    # the same weights and float32 ops (measured: bit-identical); 1e-6 leaves room for a head that orders its 64-term
    # dot product otherwise (~√64·2**-24·|w|·|h| <= 1e-6, random-sign roundings); wrong head keys are off by > 1e-2
    torch.testing.assert_close(out.logits.squeeze(-1)[mask], expected[mask], rtol=0, atol=1e-6)


def test_reward_model_from_an_exported_generic_critic(tmp_path):
    from ppo_critic.run.checkpoint import export_hf

    torch.manual_seed(5)
    original = build_value_model(tiny_config("qwen2"), head="generic", value_head_init="normal:0.3").eval()
    export_hf(original, tmp_path / "exported")
    copy = build_value_model(tiny_config("qwen2"), value_head_init=f"from_reward_model:{tmp_path / 'exported'}")
    batch = make_batch(8, 6, 5, seed=6)
    opt = torch.optim.SGD(original.parameters(), lr=0.0)
    a = DataParallelPPOCritic({"ppo_mini_batch_size": 8}, original, opt).compute_values(batch)
    b = DataParallelPPOCritic({"ppo_mini_batch_size": 8}, copy, opt).compute_values(batch)
    # the same weights through another head module: as above (measured: bit-identical)
    torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    assert a.abs().sum() > 0


def test_reward_models_that_do_not_fit_are_explained(tmp_path):
    from transformers import AutoConfig, AutoModelForSequenceClassification

    fields = tiny_config("qwen2")
    two = AutoModelForSequenceClassification.from_config(AutoConfig.for_model(fields.pop("model_type"), **fields))
    two.save_pretrained(tmp_path / "two_labels")  # num_labels=2 by default
    with pytest.raises(ValueError, match=r"no scalar head.*num_labels=1"):
        build_value_model(tiny_config("qwen2"), value_head_init=f"from_reward_model:{tmp_path / 'two_labels'}")
    fields = tiny_config("qwen2")
    one = AutoModelForSequenceClassification.from_config(
        AutoConfig.for_model(fields.pop("model_type"), **fields, num_labels=1)
    )
    one.save_pretrained(tmp_path / "rm")
    with pytest.raises(ValueError, match=r"does not fit the critic's backbone: missing \[\], unexpected \['layers.1"):
        build_value_model(
            tiny_config("qwen2", num_hidden_layers=1), value_head_init=f"from_reward_model:{tmp_path / 'rm'}"
        )
    with pytest.raises(ValueError, match=r"does not fit the critic's backbone: .*size mismatch"):
        build_value_model(tiny_config("qwen2", hidden_size=32), value_head_init=f"from_reward_model:{tmp_path / 'rm'}")
    with pytest.raises(FileNotFoundError, match="not a directory"):
        build_value_model(tiny_config("qwen2"), value_head_init="from_reward_model:/nonexistent/rm")


def test_fp32_head_under_bf16_autocast_with_packing():
    """Remove-padding critic in bf16 autocast: the head runs in fp32 on the packed row, and trains in fp32."""
    torch.manual_seed(0)
    model = build_value_model(tiny_config("qwen2"), value_head_init="normal:0.3", value_head_dtype="float32")
    cfg = {"ppo_mini_batch_size": 8, "dtype": "bfloat16", "model": {"use_remove_padding": False}}
    padded = DataParallelPPOCritic(cfg, copy.deepcopy(model), None)
    head = model.score
    seen = []
    head.register_forward_hook(lambda m, args, out: seen.append(out.dtype))
    cfg["model"] = {"use_remove_padding": True}
    critic = DataParallelPPOCritic(cfg, model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    batch = make_batch(8, 6, 5, seed=7)
    values = critic.compute_values(batch)
    assert seen and all(dtype == torch.float32 for dtype in seen)  # bf16 hidden states in, fp32 values out
    # bf16 backbone: every op rounds to 8 significant bits (u = 2**-9 ~ 2e-3) and the two paths round differently
    # through ~25 ops of 2 layers: <= ~25u ~ 0.05 of the O(1) values (measured 4e-3); a wrong mask is off by ~0.3
    torch.testing.assert_close(values, padded.compute_values(batch), rtol=0.05, atol=0.05)
    batch["values"] = values
    before = head.weight.detach().clone()
    critic.update_critic(batch)
    assert head.weight.dtype == torch.float32 and not torch.equal(head.weight, before)


def test_popart_rescales_the_head_copy_that_peft_trains():
    """verl 0.7's LoRA critic is peft's TOKEN_CLS model: the head `score` becomes a frozen original beside the copy that
    runs and trains. PopArt must rescale that copy, or the critic's raw values jump whenever the statistics move."""
    from peft import LoraConfig, TaskType, get_peft_model

    torch.manual_seed(0)
    lora = LoraConfig(task_type=TaskType.TOKEN_CLS, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    model = get_peft_model(build_value_model(tiny_config("qwen2")), lora)
    parent, name = find_value_head(model)
    assert getattr(parent, name).weight.requires_grad  # the copy in use, not `original_module`
    critic = DataParallelPPOCritic(
        {"ppo_mini_batch_size": 8, "value_norm": "popart"}, model, torch.optim.SGD(model.parameters(), lr=0.1)
    )
    batch = make_batch()
    before = critic.compute_values(batch)
    critic.update_value_norm(batch["returns"] * 3 + 2, torch.ones_like(batch["returns"]))
    assert critic.value_norm.mean.item() == pytest.approx(2, abs=1)
    # PopArt's rescale in float64, stored in float32: the outputs move by float32 rounding (values are O(1))
    torch.testing.assert_close(critic.compute_values(batch), before, rtol=0, atol=1e-5)


@pytest.mark.parametrize("head", ["auto", "generic"])
def test_only_a_whole_critic_passes_as_one_to_score_with(tmp_path, head):
    from safetensors.torch import load_file, save_file

    from ppo_critic.models.hf import VALUE_HEAD_FILE, check_trained_critic
    from ppo_critic.run.checkpoint import export_hf

    export_hf(build_value_model(tiny_config("qwen2"), head=head), tmp_path / "critic")
    check_trained_critic(tmp_path / "critic")

    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text((tmp_path / "critic" / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match="no_weights holds no weights"):
        check_trained_critic(no_weights)

    headless = tmp_path / "headless"
    export_hf(build_value_model(tiny_config("qwen2"), head=head), headless)
    (headless / VALUE_HEAD_FILE).unlink(missing_ok=True)
    weights = load_file(headless / "model.safetensors")
    save_file({k: v for k, v in weights.items() if not k.startswith("score.")}, headless / "model.safetensors")
    with pytest.raises(ValueError, match=r"headless holds no value head \(score\.\*"):
        check_trained_critic(headless)
    from ppo_critic.cli import main

    data = tmp_path / "rollouts.jsonl"
    data.write_text('{"prompt_ids": [1, 2], "response_ids": [3], "reward": 1.0}\n')
    for directory in (no_weights, headless):
        with pytest.raises(SystemExit) as exit_:
            main(["values", str(directory), f"data={data}", f"out={tmp_path / 'values.jsonl'}"])
        assert exit_.value.code == 2 and not (tmp_path / "values.jsonl").exists()


@pytest.mark.parametrize("vocab", [0, -3])
def test_a_model_that_embeds_no_token_ids_is_refused_naming_vocab_size(vocab):
    """Issue 43 family 10: vocab_size=0 built a model no batch could enter."""
    with pytest.raises(ValueError, match=rf"vocab_size={vocab} must be a positive integer"):
        build_value_model(tiny_config(), override_config={"vocab_size": vocab})


def test_a_file_given_as_the_model_path_is_named_a_file(tmp_path):
    """Issue 43 family 8: a README given as the model was called "a local directory without a valid config.json"."""
    readme = tmp_path / "README.md"
    readme.write_text("hello\n")
    with pytest.raises(FileNotFoundError, match=r"model path '.*README.md' is a file, not a model directory"):
        build_value_model(readme)


def test_a_module_that_reads_no_token_ids_is_refused_as_the_critics_model():
    """Issue 43 family 8: an nn.Linear failed inside its forward ("unexpected keyword argument 'input_ids'")."""
    linear = nn.Linear(4, 1)
    with pytest.raises(TypeError, match=r"critic_module is a Linear, whose forward takes no input_ids"):
        DataParallelPPOCritic({"ppo_mini_batch_size": 4}, linear, torch.optim.SGD(linear.parameters(), lr=0.1))


def test_weights_that_do_not_match_their_config_are_named_with_their_sizes(tmp_path):
    """Issue 43 family 8: an HF config that disagrees with its weights raised transformers' RuntimeError pointing at
    a report it had not shown ("look at the above report")."""
    from transformers import AutoModelForTokenClassification, Qwen2Config

    from conftest import TINY

    model = tmp_path / "model"
    AutoModelForTokenClassification.from_config(Qwen2Config(**TINY, num_labels=1)).save_pretrained(model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "hidden_size": 2 * config["hidden_size"]}))
    size = config["hidden_size"]
    with pytest.raises(
        ValueError, match=rf"do not match its config.json \(.*: \[{size}\] in the weights, \[{2 * size}\]"
    ):
        build_value_model(model)


def test_a_config_transformers_rejects_as_a_whole_is_one_line_naming_the_file_or_the_option(tmp_path, capsys):
    """Issue 52: `values` on an export whose config.json has one more layer than its layer_types ended in
    huggingface_hub's validation traceback (not a ValueError); so did the same in override_config."""
    from transformers import AutoConfig

    from ppo_critic.cli import main
    from ppo_critic.models.hf import hf_config_for
    from ppo_critic.run.checkpoint import export_hf

    export_hf(build_value_model(tiny_config("qwen2")), tmp_path / "critic")
    if not getattr(AutoConfig.from_pretrained(tmp_path / "critic"), "layer_types", None):
        pytest.skip("this transformers' Qwen2 config has no layer_types to disagree with")
    config_file = tmp_path / "critic" / "config.json"
    config = json.loads(config_file.read_text())
    more = {"num_hidden_layers": config["num_hidden_layers"] + 1, "ppo_critic_vf_loss_type": "mse"}
    config_file.write_text(json.dumps(config | more))
    rule = r"`num_hidden_layers` \(3\) must be equal to the number of `layer_types` \(2\)"
    with pytest.raises(ValueError, match=rf"{config_file} is not a valid model config: {rule}; give the config.json"):
        hf_config_for(str(tmp_path / "critic"))
    data = tmp_path / "rollouts.jsonl"
    data.write_text('{"prompt_ids": [1, 2], "response_ids": [3], "reward": 1.0}\n')
    with pytest.raises(SystemExit) as exit_:
        main(["values", str(tmp_path / "critic"), f"data={data}", f"out={tmp_path / 'v.jsonl'}"])
    assert exit_.value.code == 2 and "is not a valid model config" in capsys.readouterr().err
    with pytest.raises(
        ValueError, match=rf"^the model config \(critic.model.override_config\) is not a valid .*{rule}"
    ):
        hf_config_for({**tiny_config("qwen2"), "num_hidden_layers": 3, "layer_types": ["full_attention"] * 2})
