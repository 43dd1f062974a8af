"""tools/plot_losses.py: Megatron log lines -> loss curves -> one PNG."""

import importlib.util
import os
import subprocess
import sys

import pytest

TOOL = os.path.join(os.path.dirname(__file__), "..", "tools", "plot_losses.py")


def _load_tool():
    spec = importlib.util.spec_from_file_location("plot_losses_tool", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it executes
    spec.loader.exec_module(module)
    return module


def _train_line(iteration, loss, prefix=""):
    return (
        f"{prefix} iteration {iteration:8d}/     300 | consumed samples: {iteration * 32:12d} | "
        f"elapsed time per iteration (ms): 812.4 | throughput per GPU (TFLOP/s/GPU): 151.2 | "
        f"learning rate: 1.000000E-04 | global batch size:    32 | lm loss: {loss:.6E} | "
        f"loss scale: 1.0 | grad norm: 1.234 | number of skipped iterations:   0 | "
        f"number of nan iterations:   0 | inter-node bytes per iteration: 1.2E+09 |"
    )


def _valid_line(iteration, loss, where=""):
    return (
        f" validation loss at iteration {iteration}{where} | lm loss value: {loss:.6E} | "
        f"lm loss PPL: 1.300000E+02 |"
    )


def _write_log(path, offset, prefix=""):
    lines = ["------------------------ arguments ------------------------", "  seed ..... 1234"]
    for it in range(10, 101, 10):
        lines.append(_train_line(it, 8.0 - it / 50 + offset, prefix))
        if it % 50 == 0:
            lines += ["-" * 80, _valid_line(it, 7.5 - it / 50 + offset), "-" * 80]
    lines.append(_valid_line(100, 1.0, " on test set"))
    path.write_text("\n".join(lines) + "\n")


def test_parse_log_reads_train_and_validation_losses():
    tool = _load_tool()
    lines = [
        _train_line(10, 5.123456),
        "[default0]:" + _train_line(20, 4.5),  # launcher prefixes are fine
        _valid_line(20, 4.75),
        _valid_line(20, 9.0, " on test set"),  # not validation
        _train_line(10, 5.0),  # a resumed run repeats iteration 10: the later line wins
        " iteration       30/     300 | consumed samples: 960 | loss scale: 1.0 |",  # skipped
        "elapsed time per iteration (ms): 812.4 | lm loss: 3.0E+00 |",  # not an iteration line
    ]
    curves = tool.parse_log(lines)
    assert curves.sorted("train") == ([10, 20], [5.0, 4.5])
    assert curves.sorted("valid") == ([20], [4.75])
    assert tool.parse_log(lines, loss_name="mtp loss").train == {}


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="needs matplotlib")
def test_two_logs_make_one_png(tmp_path, capsys):
    tool = _load_tool()
    _write_log(tmp_path / "a.log", 0.0)
    _write_log(tmp_path / "b.log", 0.1, prefix="[default0]:")
    output = tmp_path / "losses.png"
    argv = [str(tmp_path / "a.log"), str(tmp_path / "b.log"), "--labels", "zero3", "zeropp",
            "--output", str(output)]
    assert tool.main(argv) == 0
    with open(output, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert os.path.getsize(output) > 10_000
    out = capsys.readouterr().out
    assert "zero3: 10 train points, last 6.0000 at 100; 2 validation points, last 5.5000" in out
    assert "zeropp: 10 train points, last 6.1000 at 100" in out


def test_errors_are_reported(tmp_path, capsys):
    tool = _load_tool()
    empty = tmp_path / "empty.log"
    empty.write_text("nothing here\n")
    assert tool.main([str(empty), "--output", str(tmp_path / "x.png")]) == 2
    assert "no 'lm loss' values" in capsys.readouterr().err
    _write_log(tmp_path / "a.log", 0.0)
    assert tool.main([str(tmp_path / "a.log"), str(tmp_path / "a.log"), "--labels", "x"]) == 2
    assert "need one distinct label per log" in capsys.readouterr().err


def test_missing_matplotlib_gives_an_install_hint(tmp_path):
    _write_log(tmp_path / "a.log", 0.0)
    # A child interpreter in which `import matplotlib` fails.
    code = (
        "import sys; sys.modules['matplotlib'] = None; sys.argv = sys.argv[1:]; "
        "import runpy; runpy.run_path(sys.argv[0], run_name='__main__')"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, TOOL, str(tmp_path / "a.log"), "--output",
         str(tmp_path / "x.png")],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2
    assert "needs matplotlib: pip install matplotlib" in result.stderr
    assert not (tmp_path / "x.png").exists()
