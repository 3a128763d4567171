import pytest

from meshforge.cli.train import parse_train_args
from meshforge.config import load_config
from meshforge.errors import ConfigError
from meshforge.resolve import resolve


def test_defaults_resolve_and_fill_preset():
    cfg = resolve(load_config())
    assert cfg.shape.hidden == 128 and cfg.shape.layers == 4
    assert cfg.optim.warmup_steps == cfg.train.steps // 10
    assert cfg.layout.dp_shard == 1


def test_unknown_key_suggests_nearest():
    with pytest.raises(ConfigError, match=r"train\.stpes.*did you mean 'steps'"):
        load_config(None, {"train.stpes": 3})


def test_unknown_section_suggests_nearest():
    with pytest.raises(ConfigError, match=r"\[trian\].*did you mean 'train'"):
        load_config(None, {"trian.steps": 3})


def test_wrong_type_names_key():
    with pytest.raises(ConfigError, match=r"train\.steps must be an integer"):
        load_config(None, {"train.steps": "many"})
    with pytest.raises(ConfigError, match=r"train\.compile must be true or false"):
        load_config(None, {"train.compile": 1})


def test_literal_suggests_valid_choice():
    with pytest.raises(ConfigError, match=r"did you mean 'bf16'"):
        load_config(None, {"train.precision": "bf61"})


@pytest.mark.parametrize(
    "override, pattern",
    [
        ({"optim.lr": -1e-3}, r"optim\.lr = -0\.001 is out of range: it must be in \(0, 10\]"),
        ({"optim.lr": float("inf")}, r"optim\.lr = inf must be a finite number"),
        ({"train.steps": 0}, r"train\.steps = 0 is out of range: it must be in \[1, 1,000,000,000\]"),
        ({"train.steps": 10**23}, r"train\.steps = 10+ is far too large"),
        ({"train.seq_len": 4096}, r"train\.seq_len = 4096 is above .*model\.max_seq_len = 1024"),
        ({"train.global_batch_size": 10, "train.micro_batch_size": 4}, r"micro_batch_size = 4 must divide"),
        ({"parallel.zero_stage": 5}, r"parallel\.zero_stage = 5 is out of range: it must be in \[0, 3\]"),
        ({"model.heads": 3}, r"model\.hidden = 128 must be divisible by model\.heads = 3"),
        ({"model.rope_scaling": "lama3"}, r"model\.rope_scaling = 'lama3' is not one of .*did you mean 'llama3'"),
        ({"model.head_dim": 15}, r"head_dim.*even"),
        ({"parallel.num_microbatches": -1}, r"num_microbatches = -1 is out of range: it must be in \[0, "),
    ],
)
def test_impossible_values_refused(override, pattern):
    with pytest.raises(ConfigError, match=pattern):
        resolve(load_config(None, override))


def test_a_warmup_longer_than_the_run_is_clipped_and_said():
    """Shortening a run (--train.steps=20 on a config with 40 warm-up steps) just works."""
    plan = resolve(load_config(None, {"optim.warmup_steps": 500, "train.steps": 20}))
    assert plan.optim.warmup_steps == 20
    (change,) = plan.changes
    assert change.key == "optim.warmup_steps" and change.used == 20 and "longer than the run" in change.reason
    assert "# changed: optim.warmup_steps = 500 runs as 20" in plan.to_toml()


def test_the_resolved_config_holds_no_automatic_value():
    plan = resolve(load_config(None, {"checkpoint.interval": "auto"}))
    text = plan.to_toml()
    body = [line for line in text.splitlines() if not line.startswith("#")]
    assert not [line for line in body if '"auto"' in line], text
    assert 'precision = "fp32"' in text and 'mixed_precision = "none"' in text and 'device = "cpu"' in text
    assert "dp_shard = 1" in text and 'interval = "young_daly"' in text and plan.batch.micro == 16
    again = resolve(load_config_text(text))  # rerunning config.toml resolves to the same plan
    assert again.config == plan.config


def load_config_text(text: str):
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "c.toml").write_text(text)
        return load_config(Path(d) / "c.toml")


def test_unknown_preset_suggests():
    with pytest.raises(ConfigError, match=r"did you mean 'llama3.1-8b'"):
        resolve(load_config(None, {"model.preset": "llama3-8b"}))


def test_degrees_must_match_world_size():
    with pytest.raises(ConfigError, match=r"multiply to 2, not the world size 4.*dp_shard = 4"):
        resolve(load_config(None, {"parallel.dp_shard": 2}), world_size=4)
    with pytest.raises(ConfigError, match=r"not divisible by the data-parallel degree 3"):
        resolve(load_config(None, {"train.global_batch_size": 16}), world_size=3)


def test_toml_file_and_overrides(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('[train]\nsteps = 7\nprecision = "bf16"\n[optim]\nlr = 1e-4\n[checkpoint]\nasync = false\n')
    cfg = load_config(f, {"train.steps": 9})
    assert cfg.train.steps == 9 and cfg.train.precision == "bf16" and cfg.optim.lr == 1e-4


def test_resolved_toml_round_trips(tmp_path):
    cfg = resolve(load_config(None, {"model.preset": "llama3.2-1b", "train.seq_len": 2048, "run.dir": "x"}))
    f = tmp_path / "resolved.toml"
    f.write_text(cfg.to_toml())
    again = load_config(f)
    assert again == cfg.config


def test_malformed_toml_names_file(tmp_path):
    f = tmp_path / "bad.toml"
    f.write_text("[train\nsteps = 3\n")
    with pytest.raises(ConfigError, match=r"bad\.toml is not valid TOML"):
        load_config(f)


def test_override_syntax_both_forms_and_types():
    cfg_file, nproc, restarts, o, resume = parse_train_args(
        [
            "--train.steps=5",
            "--optim.lr",
            "3e-4",
            "--train.compile",
            "--nproc",
            "2",
            "--data.path",
            "some/dir",
        ]
    )
    assert (cfg_file, nproc, restarts, resume) == (None, 2, 0, None)
    assert o == {"train.steps": 5, "optim.lr": 3e-4, "train.compile": True, "data.path": "some/dir"}


def test_unknown_cli_flag_suggests():
    with pytest.raises(ConfigError, match=r"did you mean '--nproc'"):
        parse_train_args(["--nprocs", "2"])


def test_one_degree_may_be_inferred():
    cfg = resolve(
        load_config(None, {"parallel.dp_replicate": -1, "parallel.dp_shard": 2, "parallel.zero_stage": 3}), world_size=8
    )
    assert (cfg.layout.dp_replicate, cfg.layout.dp_shard) == (4, 2)
    with pytest.raises(ConfigError, match="only one parallel degree may be -1"):
        resolve(load_config(None, {"parallel.tp": -1}), world_size=4)
    with pytest.raises(ConfigError, match="not divisible by the fixed degrees' product 3"):
        resolve(load_config(None, {"parallel.dp_replicate": 3, "parallel.zero_stage": 2}), world_size=4)


def test_hsdp_needs_a_sharded_stage():
    with pytest.raises(ConfigError, match=r"dp_replicate = 2 .*needs parallel.zero_stage = 2 or 3.*dp_shard = 4"):
        resolve(load_config(None, {"parallel.dp_replicate": 2}), world_size=4)
    cfg = resolve(load_config(None, {"parallel.dp_replicate": 2, "parallel.zero_stage": 3}), world_size=4)
    assert cfg.layout.dp_shard == 2


def test_axes_not_yet_available_are_refused_by_name():
    assert resolve(load_config(None, {"parallel.cp": 2}), world_size=2).layout.cp == 2  # context parallel runs
    over = {"parallel.cp": 2, "parallel.dp_shard": 2, "parallel.zero_stage": 1}  # ZeRO-1 shards over dp x cp
    assert resolve(load_config(None, over), world_size=4).layout.zero_stage == 1
    with pytest.raises(ConfigError, match=r"parallel.ep = 2 splits the experts .* dense .*set parallel.ep = 1"):
        resolve(load_config(None, {"parallel.ep": 2}), world_size=1)  # expert parallelism needs an MoE model


def test_list_keys_are_checked():
    cfg = load_config(None, {"parallel.pp_layers": [3, 1]})
    assert cfg.layout.pp_layers == (3, 1)
    with pytest.raises(ConfigError, match=r"parallel.pp_layers must be a list"):
        load_config(None, {"parallel.pp_layers": 4})
    with pytest.raises(ConfigError, match=r"parallel.pp_layers\[1\] must be an integer"):
        load_config(None, {"parallel.pp_layers": [3, "x"]})


TP_SHAPE = {"model.hidden": 64, "model.heads": 8, "model.kv_heads": 4, "model.ffn_hidden": 128}


@pytest.mark.parametrize(
    "override, tp, pattern",
    [
        ({"model.heads": 4, "model.kv_heads": 4}, 8, r"model.heads = 4 is not divisible by parallel.tp = 8.*e.g. 4"),
        ({"model.kv_heads": 2}, 4, r"model.kv_heads = 2 is not divisible by parallel.tp = 4 .*key/value heads"),
        ({"model.ffn_hidden": 130}, 4, r"model.ffn_hidden = 130 is not divisible by parallel.tp = 4.*e.g. 2"),
        ({"model.vocab_size": 258}, 4, r"model.vocab_size = 258 .*pad the vocabulary: set --model.vocab_size=260"),
        ({"train.seq_len": 30}, 4, r"train.seq_len = 30 .*sequence parallelism.*e.g. 32.*sequence_parallel = false"),
        ({"parallel.zero_stage": 1}, 2, r"zero_stage = 1 with parallel.tp = 2.*zero_stage = 2"),
    ],
)
def test_tp_shapes_that_do_not_split_are_refused(override, tp, pattern):
    with pytest.raises(ConfigError, match=pattern):
        resolve(load_config(None, {**TP_SHAPE, "parallel.tp": tp, **override}), world_size=tp)


def test_tp_accepts_what_splits_and_seq_len_needs_sp_only():
    cfg = resolve(load_config(None, {**TP_SHAPE, "parallel.tp": 4}), world_size=8)
    assert (cfg.layout.tp, cfg.layout.dp_shard, cfg.layout.sequence_parallel) == (4, 2, True)
    o = {**TP_SHAPE, "parallel.tp": 4, "train.seq_len": 30, "parallel.sequence_parallel": False}
    assert resolve(load_config(None, o), world_size=4).train.seq_len == 30


def test_tp_must_stay_inside_a_node(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match=r"parallel.tp = 4 is larger than the 2 ranks per node.*tp <= 2"):
        resolve(load_config(None, {**TP_SHAPE, "parallel.tp": 4}), world_size=8)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert resolve(load_config(None, {**TP_SHAPE, "parallel.tp": 4}), world_size=8).layout.tp == 4
