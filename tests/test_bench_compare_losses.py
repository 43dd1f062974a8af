"""benchmarks/compare_losses.py: Megatron-LM's fields compared as printed, the clock and this
project's extra fields left out, and a difference in any one field found."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks"))
import compare_losses  # noqa: E402

MLM = (" [2026-12-01 14:19:45.629173] iteration        {i}/      20 | consumed samples:"
       "           16 | elapsed time per iteration (ms): {ms} | learning rate: {lr} | global "
       "batch size:    16 | lm loss: 6.968970E+00 | loss scale: 1.0 | grad norm: 1.529 | number"
       " of skipped iterations:   0 | number of nan iterations:   0 |")
OURS_EXTRA = " tokens per second: 4442.7 | peak memory (GB): 0.178 |"
VALID = " validation loss at iteration 10 on validation set | lm loss value: 5.594570E+00 | " \
        "lm loss PPL: 2.690497E+02 |"


def _write(tmp_path, name, lines):
    (tmp_path / f"{name}.log").write_text("\n".join(lines) + "\n")


def test_every_megatron_lm_field_is_compared_and_the_clock_is_not(tmp_path, capsys):
    lr = "1.500000E-04"
    _write(tmp_path, "mlm", [MLM.format(i=1, ms=3796.9, lr=lr), MLM.format(i=2, ms=200.1, lr=lr),
                             VALID])
    _write(tmp_path, "ours", [MLM.format(i=1, ms=922.0, lr=lr) + OURS_EXTRA,
                              MLM.format(i=2, ms=90.3, lr=lr) + OURS_EXTRA, VALID])
    # Negative control: the learning rate's last digit alone (item 6 of issue 36).
    _write(tmp_path, "lr", [MLM.format(i=1, ms=1.0, lr=lr),
                            MLM.format(i=2, ms=1.0, lr="1.500001E-04"), VALID])
    compare_losses.main([str(tmp_path), "mlm", "ours", "lr"])
    out = capsys.readouterr().out.splitlines()
    assert "mlm vs ours: 3/3 lines identical as printed" in out
    assert ("mlm vs lr: 2/3 lines identical as printed, first difference at 2: learning rate "
            "'1.500000E-04' vs '1.500001E-04'") in out
    logs = compare_losses.read(str(tmp_path / "mlm.log"))
    assert [n for n, _ in logs[1]] == ["consumed samples", "learning rate", "global batch size",
                                      "lm loss", "loss scale", "grad norm",
                                      "number of skipped iterations", "number of nan iterations"]
    assert dict(logs["validation iteration 10 on validation set"]) == {
        "lm loss value": "5.594570E+00", "lm loss PPL": "2.690497E+02"}
