"""Model problems found before the model is built, all of one config in one report (issue 37).

In-process and model-free: `config_from_dict(raw, checks=config_problems)` is what the CLI runs
before anything is built. Each case is a row of docs/failures.md's bad-input table.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from lmms_train._errors import ConfigError
from lmms_train._preflight import config_problems
from lmms_train.config import config_from_dict

ROOT = Path(__file__).resolve().parents[3]


def _problems(example: str, tmp_path: Path, **sections: dict) -> list[str]:
    raw = yaml.safe_load((ROOT / "examples" / example).read_text())
    raw["trainer_args"]["output_dir"] = str(tmp_path / "out")
    for section, values in sections.items():
        for key, value in values.items():
            node = raw.setdefault(section, {})
            if isinstance(value, dict) and isinstance(node.get(key), dict):
                node[key] = {**node[key], **value}
            else:
                node[key] = value
    try:
        config_from_dict(raw, checks=config_problems)
    except ConfigError as exc:
        return exc.problems
    return []


def _one(problems: list[str], *needles: str) -> None:
    hits = [p for p in problems if all(n in p for n in needles)]
    assert len(hits) == 1, (needles, problems)


def test_sit_config_every_problem_once(tmp_path):
    """The SiT config of the issue: an objective typo, a typo in the nested model config, EMA out
    of range, SP 3 on a family without SP (and on one process), a policy typo: one report, each
    problem once."""
    problems = _problems(
        "sit/tiny_cpu.yaml", tmp_path,
        model_config={"objective": "flow_matchin", "load_from_config": {"config": {"hiden_size": 8}}},
        trainer_args={"ema_decay": 1.5, "sp_ulysses_degree": 3},
        dataset_config={"bad_record_policy": "skp"},
    )  # fmt: skip
    _one(problems, "objective 'flow_matchin' is not registered", "did you mean 'flow_matching'")
    _one(problems, "config does not read 'hiden_size' (did you mean 'hidden_size'?)")
    _one(problems, "ema_decay must be in (0, 1)", "1.5")
    _one(problems, "sp_ulysses_degree", "sit has no sequence-parallel path")
    _one(problems, "world size 1 is not divisible by sp_ulysses_degree (3)")
    assert len([p for p in problems if "bad_record_policy" in p]) == 1, problems
    assert len(problems) == 6, problems


@pytest.mark.parametrize(
    ("example", "objective", "args", "needle"),
    [
        ("llama/tiny_cpu.yaml", "flow_matching", {}, "a denoiser of latents"),
        ("llama/tiny_cpu.yaml", "ce_flow_matching", {}, "flow matching on image latents"),
        ("sit/tiny_cpu.yaml", "masked_diffusion", {"mask_token_id": 1}, "a language model"),
        ("sit/tiny_cpu.yaml", "causal_lm", {}, "a language model"),
        ("fla_gated_deltanet/tiny_cpu.yaml", "masked_diffusion", {"mask_token_id": 1},
         "can be made bidirectional"),
    ],
)  # fmt: skip
def test_objective_that_does_not_fit_the_family(tmp_path, example, objective, args, needle):
    problems = _problems(
        example, tmp_path, model_config={"objective": objective, "objective_args": args}
    )
    _one(problems, f"model_config.objective: objective {objective!r} needs", needle, "trains:")


def test_every_family_fits_its_default_objective():
    """What each family declares lets its own objective (and the causal LM for token LMs) in."""
    from lmms_models import get_model_spec, list_models
    from lmms_models.objectives import OBJECTIVE_REGISTRY

    for name in list_models():
        spec = get_model_spec(name)
        assert OBJECTIVE_REGISTRY[spec.default_objective].family_problem(spec) is None, name
        token_lm = "token_lm" in spec.objective_capabilities()
        assert (OBJECTIVE_REGISTRY["causal_lm"].family_problem(spec) is None) == token_lm, name


def test_sp_and_world_size(tmp_path, monkeypatch):
    problems = _problems("llama/tiny_cpu.yaml", tmp_path, trainer_args={"sp_ulysses_degree": 3})
    _one(problems, "sp_ulysses_degree 3 must divide the 4 attention heads")
    monkeypatch.setenv("WORLD_SIZE", "2")
    problems = _problems("llama/tiny_cpu.yaml", tmp_path, trainer_args={"sp_ulysses_degree": 3})
    _one(problems, "world size 2 is not divisible by sp_ulysses_degree (3)")
    assert _problems("llama/tiny_cpu.yaml", tmp_path, trainer_args={"sp_ulysses_degree": 2}) == []


def test_nested_model_config_keys_and_values(tmp_path):
    problems = _problems(
        "qwen2_5_vl/tiny_cpu_muon.yaml", tmp_path,
        model_config={"load_from_config": {"config": {
            "text_config": {"hiden_size": 64, "rope_theta": 1e4}, "vision_config": {"dept": 2},
        }}},
    )  # fmt: skip
    _one(problems, "'text_config.hiden_size' (did you mean 'hidden_size'?)")
    _one(problems, "'vision_config.dept' (did you mean 'depth'?)")
    # the tiny config gives rope_parameters: a rope_theta beside it is never read
    _one(problems, "'text_config.rope_theta'")
    # llama's config consumes rope_theta (into rope_parameters): accepted
    problems = _problems(
        "llama/tiny_cpu.yaml", tmp_path,
        model_config={"load_from_config": {"config": {"rope_theta": 5e5, "num_hidden_layers": 0}}},
    )  # fmt: skip
    assert problems == ["model_config.load_from_config.config: num_hidden_layers must be a "
                        "positive integer, got 0"], problems  # fmt: skip
    problems = _problems(
        "llama/tiny_cpu.yaml", tmp_path,
        model_config={"load_from_config": {"config": {"num_key_value_heads": 3}}},
    )  # fmt: skip
    _one(problems, "num_key_value_heads (3) must divide num_attention_heads (4)")
    problems = _problems(
        "llama/tiny_cpu.yaml", tmp_path,
        model_config={"load_from_config": {"config": {"attn_implementation": "eager"}}},
    )  # fmt: skip
    _one(problems, "does not read 'attn_implementation'", "set trainer_args.attn_backend instead")


def test_no_family_config_of_the_repository_has_an_ignored_key():
    """Tiny configs, presets and the examples' nested configs pass the unknown-key check (a key
    no config reads is an error: this keeps the check from refusing what the families ship)."""
    from lmms_models import get_model_spec, list_models

    for name in list_models():
        spec = get_model_spec(name)
        for conf in [spec.tiny_config(), *(spec.preset(p) for p in spec.presets)]:
            assert spec.unknown_config_keys(conf) == [], name
    for path in sorted((ROOT / "examples").glob("*/*.yaml")):
        lfc = (yaml.safe_load(path.read_text()).get("model_config") or {}).get("load_from_config")
        if lfc and lfc.get("config"):
            spec = get_model_spec(lfc["model_type"])
            preset = spec.preset(lfc["preset"]) if lfc.get("preset") else {}
            base = spec.tiny_config() if lfc.get("tiny") else preset
            assert spec.unknown_config_keys(lfc["config"], base) == [], path


def test_numeric_ranges(tmp_path):
    problems = _problems(
        "llama/tiny_cpu.yaml", tmp_path,
        trainer_args={"ema_decay": 0.0, "gc_full_collect_steps": -1},
        dataset_config={"min_pixels": 100, "max_pixels": 10, "video_fps": 0, "num_epochs": 0},
    )  # fmt: skip
    for needle in ("ema_decay must be in (0, 1)", "gc_full_collect_steps must be >= 0",
                   "min_pixels must be <= max_pixels", "video_fps must be > 0",
                   "num_epochs must be >= 1"):  # fmt: skip
        _one(problems, needle)


def test_placement_switches(tmp_path):
    problems = _problems(
        "sit/tiny_cpu.yaml", tmp_path,
        trainer_args={"frozen_encoders": "offload", "fsdp": False, "fsdp_cpu_offload": True},
    )  # fmt: skip
    _one(problems, "frozen_encoders: offload is for families with a frozen", "not sit")
    _one(problems, "fsdp_cpu_offload needs FSDP")
