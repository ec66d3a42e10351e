from dataclasses import dataclass, field
from typing import Any, Literal

import pytest

from torchloom.cli import main
from torchloom.config import (
    ConfigError,
    apply_overrides,
    field_docs,
    format_help,
    from_dict,
    to_dict,
)
from torchloom.config.overrides import split_overrides, validate_tree


@dataclass
class Inner:
    steps: int = 10
    """How many steps."""
    lr: float = 1e-3
    """Peak learning rate.
    Second line."""
    name: str = "x"
    flag: bool = False
    """A switch."""
    mode: Literal["a", "b"] = "a"
    items: list[str] = field(default_factory=list)
    weights: list[float] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    maybe: int | None = None

    def validate(self) -> None:
        if self.steps < 1:
            raise ConfigError("steps must be >= 1")


@dataclass
class Outer:
    training: Inner = field(default_factory=Inner)
    other: Inner = field(default_factory=Inner)


def test_field_docs_read_attribute_docstrings():
    docs = field_docs(Inner)
    assert docs["steps"] == "How many steps."
    assert docs["lr"] == "Peak learning rate.\nSecond line."
    assert "name" not in docs


def test_overrides_parse_every_type():
    cfg = apply_overrides(
        Outer(),
        [
            "--training.steps", "20",
            "--training.lr=3e-4",
            "--training.name", "hello",
            "--training.flag",
            "--training.mode", "b",
            "--training.items", '["p", "q"]',
            "--training.extra", '{"num_layers": 4}',
            "--training.maybe", "none",
            "--other.items", "u,v",
            "--other.weights", "0.6, 0.4",
        ],
    )  # fmt: skip
    t = cfg.training
    assert (t.steps, t.lr, t.name, t.flag, t.mode) == (20, 3e-4, "hello", True, "b")
    assert t.items == ["p", "q"] and t.extra == {"num_layers": 4} and t.maybe is None
    assert cfg.other.items == ["u", "v"] and cfg.other.weights == [0.6, 0.4]
    assert Outer().training.steps == 10  # the input is not modified


def test_unknown_field_names_near_matches():
    with pytest.raises(ConfigError, match=r"--trainig\.steps.*Did you mean '--?training\.steps'"):
        apply_overrides(Outer(), ["--trainig.steps", "3"])
    with pytest.raises(ConfigError, match=r"training\.steps"):
        apply_overrides(Outer(), ["--training.step", "3"])


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--training.steps", "ten"], "expects an integer"),
        (["--training.lr", "fast"], "expects a number"),
        (["--training.flag", "maybe"], "true or false"),
        (["--training.mode", "c"], "must be one of a, b"),
        (["--training.extra", "nope"], "JSON object"),
        (
            ["--training.weights", "a,b"],
            r"expects a list of float.*Example: --training.weights '\[0.6, 0.4\]'",
        ),
        (["--training.weights", "[0.7, 0.3"], "expects a JSON list .*at character"),
        (["--training.items", '["p"'], "expects a JSON list"),
        (["--training.steps"], "needs a value"),
        (["training.steps", "3"], "Unexpected argument"),
    ],
)
def test_ill_typed_values_are_refused_clearly(argv, message):
    with pytest.raises(ConfigError, match=message):
        apply_overrides(Outer(), argv)


def test_split_overrides_pairs_flags_and_values():
    assert split_overrides(["--a.b", "1", "--c", "--d=2"]) == [
        ("a.b", "1"),
        ("c", None),
        ("d", "2"),
    ]


def test_validate_tree_calls_each_section():
    cfg = apply_overrides(Outer(), ["--other.steps", "0"])
    with pytest.raises(ConfigError, match="steps must be >= 1"):
        validate_tree(cfg)


def test_dict_round_trip_and_unknown_key():
    cfg = apply_overrides(Outer(), ["--training.items", "a,b", "--other.extra", '{"k": [1]}'])
    assert from_dict(Outer, to_dict(cfg)) == cfg
    with pytest.raises(ConfigError, match="Unknown config field 'training.stesp'"):
        from_dict(Outer, {"training": {"stesp": 1}})
    with pytest.raises(ConfigError, match="training.steps expects int"):
        from_dict(Outer, {"training": {"steps": "1"}})


def test_help_lists_paths_types_defaults_and_docs():
    text = format_help(Outer(), "title")
    assert "--training.steps int  (default: 10)" in text
    assert "How many steps." in text
    assert "--other.mode a|b" in text


def test_the_right_field_in_another_section_is_suggested_first():
    @dataclass
    class Training:
        seed: int = 0
        seq_len: int = 8
        steps: int = 1

    @dataclass
    class Optimizer:
        lr: float = 1e-3

    @dataclass
    class Job:
        training: Training = field(default_factory=Training)
        optimizer: Optimizer = field(default_factory=Optimizer)

    with pytest.raises(ConfigError, match=r"--training\.lr\. Did you mean '--optimizer\.lr'"):
        apply_overrides(Job(), ["--training.lr", "0.1"])


def test_an_option_given_twice_keeps_the_last_and_warns(capsys):
    """Scripts append the user's flags to their own (benchmarks/vs_torchtitan.py
    --torchloom-args), so the last value wins; the warning names both, and that a dict is
    replaced, not merged. The same value twice changes nothing and says nothing."""
    cfg = apply_overrides(Outer(), ["--training.steps", "3", "--training.steps=1"])
    assert cfg.training.steps == 1
    assert capsys.readouterr().err == (
        "warning: --training.steps is given twice (3, then 1); the last one is used.\n"
    )
    cfg = apply_overrides(Outer(), ["--other.extra", '{"a": 1}', "--other.extra", '{"b": 2}'])
    assert cfg.other.extra == {"b": 2}
    assert "the last one is used, not merged with the first." in capsys.readouterr().err
    apply_overrides(Outer(), ["--training.flag", "--training.flag", "true"])
    assert capsys.readouterr().err == ""


def test_a_dict_that_replaces_the_recipes_names_the_keys_it_drops(capsys):
    """llama3_tiny's overrides set its width and heads: --model.overrides '{"num_layers": 2}'
    quietly built the debug flavor's 0.6M model instead of a 2-layer tiny one."""
    base = Outer()
    base.other.extra = {"dim": 192, "num_layers": 4}
    cfg = apply_overrides(base, ["--other.extra", '{"num_layers": 2}'])
    assert cfg.other.extra == {"num_layers": 2}  # replaced, as documented
    assert capsys.readouterr().err == (
        "warning: --other.extra replaces the recipe's, so its dim go back to the flavor's; to "
        'keep them, give them in the same dict ("dim": 192).\n'
    )
    apply_overrides(base, ["--other.extra", '{"num_layers": 2, "dim": 192}'])
    assert capsys.readouterr().err == ""
    main(["train", "--recipe", "llama3_tiny", "--model.overrides", '{"dim": 100}', "--dry-run"])
    warning, error = capsys.readouterr().err.splitlines()
    assert '"num_heads": 6' in warning
    assert error == (
        "error: head_dim must be positive and even for RoPE, got 25 (dim 100 / num_heads 4); "
        "change dim or num_heads in --model.overrides, or set head_dim."
    )


def test_a_choice_typed_under_another_name_suggests_that_choice():
    @dataclass
    class Training:
        device: Literal["auto", "cpu", "cuda"] = "auto"

    @dataclass
    class Job:
        training: Training = field(default_factory=Training)

    with pytest.raises(ConfigError, match=r"got 'gpu'\. Did you mean 'cuda'\?$"):
        apply_overrides(Job(), ["--training.device", "gpu"])
    with pytest.raises(ConfigError, match=r"got 'cpux'\. Did you mean 'cpu'\?$"):
        apply_overrides(Job(), ["--training.device", "cpux"])
