"""Config loading: types, overrides, unknown keys with suggestions, validation messages."""

from __future__ import annotations

import textwrap

import pytest

from lmms_train._errors import ConfigError
from lmms_train.config import config_from_dict, config_to_dict, load_config

BASE = {
    "model_config": {"load_from_config": {"model_type": "qwen2", "tiny": True}},
    "dataset_config": {"dataset_path": "data/train.jsonl"},
    "trainer_args": {"max_steps": 5},
}


def _write(tmp_path, text):
    p = tmp_path / "c.yaml"
    p.write_text(textwrap.dedent(text))
    return p


def test_load_and_overrides(tmp_path):
    p = _write(
        tmp_path,
        """
        model_config: {load_from_config: {model_type: qwen2, tiny: true, config: {hidden_size: 32}}}
        dataset_config: {dataset_path: d.jsonl, packing_length: 512}
        trainer_args: {max_steps: 3, learning_rate: 1e-3, freeze: vision_tower}
    """,
    )
    cfg = load_config(
        p,
        [
            "trainer_args.max_steps=7",
            "model_config.load_from_config.config.num_hidden_layers=1",
            "trainer_args.optimizer=muon",
        ],
    )
    assert cfg.trainer_args.max_steps == 7
    assert cfg.trainer_args.learning_rate == pytest.approx(1e-3)  # YAML 1.1 string "1e-3" coerced
    assert cfg.trainer_args.freeze == ["vision_tower"]
    assert cfg.trainer_args.optimizer == "muon"
    assert cfg.model_config.load_from_config.config == {"hidden_size": 32, "num_hidden_layers": 1}
    assert cfg.dataset_config.packing_length == 512
    again = config_from_dict(config_to_dict(cfg))
    assert again == cfg


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("trainer_args.max_step=3", "did you mean 'max_steps'"),
        ("trainer_args.optimizer=mun", "did you mean 'muon'"),
        ("trainer_args.max_steps=abc", "expected an integer"),
        ("trainer_args.bf16=maybe", "expected true or false"),
        ("dataset_confg.packing=true", "did you mean 'dataset_config'"),
        ("trainer_args.max_steps=0", "max_steps must be > 0"),
        ("trainer_args.report_to=[wandbb]", "did you mean 'wandb'"),
        ("trainer_args.use_rmpad=false", "use_rmpad: true"),
        ("trainer_args.profile_steps=[3,2]", "profile_steps must be"),
        ("trainer_args.profile_steps=[0,1]", "profile_steps must be"),
        ("trainer_args.profile_steps=[5]", "profile_steps must be"),
    ],
)
def test_bad_values_name_the_key(override, message):
    import copy

    from lmms_train.config import apply_overrides

    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        config_from_dict(apply_overrides(copy.deepcopy(BASE), [override]))


def test_malformed_yaml_and_missing_file(tmp_path):
    p = _write(tmp_path, "trainer_args: {max_steps: [1\n")
    with pytest.raises(ConfigError, match="malformed YAML"):
        load_config(p)
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")


def test_model_source_exactly_one():
    bad = {**BASE, "model_config": {}}
    with pytest.raises(ConfigError, match="exactly one"):
        config_from_dict(bad)
