"""picofx train --float8: the precision pass with float8, added when --passes lacks it."""
import pytest

from picofx.cli.train_args import parse_args, picofx_passes
from picofx.passes import Precision


@pytest.mark.parametrize("argv, expected", [
    (["--float8", "tensorwise"], ["fuse", Precision(float8="tensorwise")]),
    (["--passes", "fuse", "precision", "--float8", "rowwise", "--float8-layers", "all"],
     ["fuse", Precision(float8="rowwise", float8_layers="all")]),
    (["--passes", "--float8", "tensorwise", "--float8-layers", "layers.*.mlp.*, layers.0.*"],
     [Precision(float8="tensorwise", float8_layers=("layers.*.mlp.*", "layers.0.*"))]),
])
def test_float8_adds_or_sets_the_precision_pass(argv, expected):
    assert picofx_passes(parse_args(argv, environ={})) == expected


@pytest.mark.parametrize("argv, message", [
    (["--float8-layers", "all"], "--float8-layers selects the layers --float8 runs in float8: add --float8"),
    (["--float8", "fast"], "invalid choice: 'fast'"),
])
def test_bad_float8_options_are_one_line_and_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args(argv, environ={})
    assert exit_.value.code == 2 and message in capsys.readouterr().err
