"""torch_dist checkpoints cross between the supported megatron-core versions, both ways.

Needs one Python per megatron-core release: their commands in ``ZEROPP_MCORE_PYTHONS``,
separated by ``os.pathsep`` (``.ci/run`` sets it: 0.16.1 under Python 3.11, 0.19.2 in the
Python 3.12 venv, 0.17.1 and 0.18.2 through small scripts that put their ``pip install
--target`` directory first on ``PYTHONPATH``); skipped otherwise. Each runs with this checkout
on ``PYTHONPATH`` and finds its own megatron-core.

Every run is a real pretrain_gpt.py job (2 ranks as 2 nodes, all three ZeRO++ flags, the
sample corpus, one 12-iteration schedule). The newest version trains uninterrupted (R); then,
from its checkpoint 2, a relay of one-iteration legs, each under one version loading the
checkpoint the previous leg saved under another, must print R's loss and grad norm of its
iteration bit for bit. The relay crosses every pair of (oldest, newest) and (each other version,
oldest or newest) both ways:

    newest -> m -> oldest -> m -> newest   for each other version m, then
    newest -> oldest -> newest

(with 0.16.1, 0.17.1, 0.18.2 and 0.19.2: 10 legs), so a checkpoint written by either version
of each pair resumes bit-exactly under the other; a leg is a torch_dist resume under its own
version too.
"""

import os
import re
import subprocess

import pytest

PYTHONS = [p for p in os.environ.get("ZEROPP_MCORE_PYTHONS", "").split(os.pathsep) if p]
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ITERS = 12

pytestmark = pytest.mark.skipif(
    len(PYTHONS) < 2, reason="ZEROPP_MCORE_PYTHONS (Pythons with other megatron-cores) unset")


def _env():
    return dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")


def _mcore(python):
    out = subprocess.run(
        [python, "-c", "from megatron_zeropp.mcore.version import mcore_version as v; "
                       "print('.'.join(map(str, v())))"],
        capture_output=True, text=True, cwd=REPO, env=_env(), timeout=120)
    assert out.returncode == 0, (python, out.stderr[-2000:])
    return tuple(int(x) for x in out.stdout.split("."))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train(python, data, exit_at, save, load=None, step=None):
    # The data files themselves, not --sample-data: the sample corpus is built from the running
    # Python's standard library, so each version would train on other text. Each job has its
    # own megatron-core index cache. --padded-vocab-size: Megatron-LM core_v0.16.1 pads a
    # SentencePiece vocabulary with its legacy tokenizer's special pieces (4096 -> 4224 rows),
    # core_v0.17.1 and later do not (4096), so the versions build other embeddings by default.
    argv = (f"--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 "
            f"--micro-batch-size 2 --global-batch-size 8 --lr 3e-3 --train-iters {ITERS} "
            f"--exit-interval {exit_at} "
            f"--log-interval 1 --eval-interval 1000 --eval-iters 0 "
            f"--tokenizer-type SentencePieceTokenizer --tokenizer-model {data.tokenizer_model} "
            f"--train-data-path {data.train_data_prefix} "
            f"--valid-data-path {data.valid_data_prefix} --data-cache-path {save}.cache "
            f"--padded-vocab-size 4224 "
            f"--ranks-per-node 1 --ckpt-format torch_dist --save {save} --save-interval 1 "
            f"--zeropp-qwz --zeropp-hpz --zeropp-qgz").split()
    if load:
        argv += ["--load", load, "--ckpt-step", str(step)]
    cmd = [python, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
           str(_free_port()), os.path.join(REPO, "pretrain_gpt.py"), *argv]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=_env(), timeout=600)
    errors = [line for line in (out.stdout + out.stderr).splitlines() if "rror" in line]
    assert out.returncode == 0, (python, "\n".join(errors[-20:]))
    return parse_losses(out.stdout)


def parse_losses(stdout):
    """iteration -> (lm loss, grad norm) as printed in pretrain_gpt.py's log lines."""
    losses = {int(m.group(1)): (m.group(2), m.group(3)) for m in re.finditer(
        r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: (\S+) \|.*?grad norm: (\S+) \|", stdout)}
    assert losses, stdout[-2000:]
    return losses


def relay(versions):
    """The versions the legs run under, in order, starting from the newest (which writes the
    first checkpoint): every (oldest, newest) and (other, oldest or newest) pair both ways."""
    ordered = sorted(set(versions))
    oldest, newest = ordered[0], ordered[-1]
    legs = []
    for middle in ordered[1:-1]:
        legs += [middle, oldest, middle, newest]
    return legs + [oldest, newest]


def crossings(legs, first):
    """The (from, to) version pairs a relay ``legs`` starting at ``first`` crosses."""
    return set(zip([first] + legs[:-1], legs))


def test_the_relay_crosses_every_required_pair_both_ways():
    v16, v17, v18, v19 = (0, 16, 1), (0, 17, 1), (0, 18, 2), (0, 19, 2)
    legs = relay([v17, v19, v16, v18])
    assert len(legs) == 10 and legs[-1] == v19
    required = {(a, b) for a, b in [(v16, v19), (v16, v17), (v16, v18), (v17, v19), (v18, v19)]}
    assert crossings(legs, v19) == required | {(b, a) for a, b in required}
    assert relay([v19, v16]) == [v16, v19]
    # Negative control: a relay missing one leg misses a crossing.
    assert crossings(legs[:-1], v19) != crossings(legs, v19)


@pytest.mark.timeout(1800)  # 11 pretrain_gpt.py jobs with 4 versions
def test_checkpoints_cross_versions_both_ways(sample_dir, tmp_path):
    from megatron_zeropp.data.sample_corpus import prepare_sample_data

    data = prepare_sample_data(sample_dir)
    python_of = {}
    for python in PYTHONS:
        version = _mcore(python)
        assert version[:2] not in {v[:2] for v in python_of}, (python, python_of)
        python_of[version] = python
    legs = relay(list(python_of))
    # As in Megatron-LM, a run's second log line averages its first two iterations: R's line 2
    # is such a mean, so the relay starts from R's checkpoint 2 (each leg prints one line).
    assert len(legs) + 2 <= ITERS
    newest = max(python_of)
    full = _train(python_of[newest], data, ITERS, str(tmp_path / "r"))
    assert sorted(full) == list(range(1, ITERS + 1))
    previous = str(tmp_path / "r")
    for step, version in enumerate(legs, start=2):
        save = str(tmp_path / f"leg{step}")
        leg = _train(python_of[version], data, step + 1, save, load=previous, step=step)
        assert leg == {step + 1: full[step + 1]}, (step, version, leg, full[step + 1])
        assert leg[step + 1] != full[step]  # (each iteration prints another line)
        previous = save
