"""TOML configs: typed validation with messages naming file and field, defaults resolved into
what run.json stores, and the JSON round trip resume depends on."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.config import (
    RESUMABLE_FIELDS,
    added_since,
    config_diff,
    load_config,
    schema_for,
    validate_config,
)
from engine.errors import ForgebenchError
from engine.recipes.lm_pretrain_config import LMPretrainConfig


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.toml"
    path.write_text(text)
    return path


def test_minimal_config_resolves_defaults_and_relative_paths(tmp_path):
    config = load_config(write(tmp_path, 'recipe = "lm-pretrain"\n[data]\ndir = "corpus"\n'))
    assert isinstance(config, LMPretrainConfig)
    assert config.base_dir == str(tmp_path.resolve())
    assert config.resolve_path(config.data.dir) == (tmp_path / "corpus").resolve()
    dumped = config.model_dump(mode="json")
    # every section is spelled out in the resolved config that run.json stores
    assert dumped["model"]["dim"] == 128 and dumped["optim"]["lr"] == 3e-3
    assert dumped["tokenizer"]["kind"] == "byte" and dumped["nonfinite"] == "skip"


def test_resolved_config_round_trips_through_json(tmp_path):
    config = load_config(write(tmp_path, 'recipe = "lm-pretrain"\nsteps = 7\n[data]\ndir = "x"\n'
                                         '[optim]\nlr = 0.1234567890123\n'))
    again = validate_config(config.model_dump(mode="json"))
    assert again == config and config_diff(config.model_dump(), again.model_dump()) == []


def test_unknown_key_names_the_nested_field(tmp_path):
    path = write(tmp_path,
                 'recipe = "lm-pretrain"\n[data]\ndir = "x"\n[optim]\nlearning_rate = 1\n')
    with pytest.raises(ForgebenchError) as info:
        load_config(path)
    assert info.value.path == str(path)
    assert "field 'optim.learning_rate': unknown key" in info.value.message


def test_several_errors_are_listed_together(tmp_path):
    path = write(tmp_path, 'recipe = "lm-pretrain"\nsteps = 0\n[model]\nn_layers = "two"\n')
    with pytest.raises(ForgebenchError) as info:
        load_config(path)
    text = info.value.message
    assert "field 'steps'" in text and "greater than or equal to 1" in text
    assert "field 'model.n_layers'" in text and "field 'data': required key is missing" in text


def test_model_shape_rules(tmp_path):
    path = write(tmp_path, 'recipe = "lm-pretrain"\n[data]\ndir = "x"\n[model]\ndim = 30\n'
                           'n_heads = 4\n')
    with pytest.raises(ForgebenchError, match="dim 30 is not divisible by n_heads 4"):
        load_config(path)
    path = write(tmp_path, 'recipe = "lm-pretrain"\n[data]\ndir = "x"\n[model]\nn_heads = 4\n'
                           'n_kv_heads = 3\n')
    with pytest.raises(ForgebenchError, match="not a multiple of n_kv_heads 3"):
        load_config(path)


def test_malformed_toml_names_line(tmp_path):
    path = write(tmp_path, 'recipe = "lm-pretrain"\n\n[data\ndir = "x"\n')
    with pytest.raises(ForgebenchError) as info:
        load_config(path)
    assert info.value.path == str(path) and "line 3" in info.value.message


def test_file_problems(tmp_path):
    with pytest.raises(ForgebenchError, match="config file not found"):
        load_config(tmp_path / "absent.toml")
    (tmp_path / "latin1.toml").write_bytes(b'recipe = "caf\xe9"\n')
    with pytest.raises(ForgebenchError, match="not UTF-8"):
        load_config(tmp_path / "latin1.toml")
    with pytest.raises(ForgebenchError, match="no 'recipe' key"):
        load_config(write(tmp_path, "steps = 3\n"))


def test_unknown_recipe_lists_the_known_ones():
    with pytest.raises(ForgebenchError) as info:
        schema_for("lm-pretrian")
    assert info.value.where == "field 'recipe'" and "lm-pretrain" in info.value.hint


def test_resumable_fields_and_diff():
    assert set(RESUMABLE_FIELDS) == {"steps", "log_every", "save_every", "eval_every",
                                     "keep_last"}
    old = {"steps": 1, "model": {"dim": 8, "n_layers": 2}}
    new = {"steps": 2, "model": {"dim": 16, "n_layers": 2}, "seed": 1}
    assert config_diff(old, new) == ["model.dim", "seed", "steps"]


def test_a_field_the_schema_gained_later_is_not_a_change_on_resume():
    """A run recorded before the schema gained a field reads as it was started: the field is
    absent from its record and validation fills the default. A recorded field that reads
    differently is still a change (the twin)."""
    stored = {"steps": 1, "model": {"dim": 8}}
    assert added_since(stored, "model.family") and added_since(stored, "data.packing")
    assert added_since(stored, "data")
    assert not added_since(stored, "model.dim") and not added_since(stored, "steps")


def test_bundled_lm_pretrain_configs_validate():
    configs = sorted((Path(__file__).resolve().parents[1] / "resources" / "configs")
                     .glob("lm-pretrain*.toml"))
    assert len(configs) >= 2
    kinds = {load_config(path).tokenizer.kind for path in configs}
    assert kinds == {"byte", "bpe", "nanochat"}
