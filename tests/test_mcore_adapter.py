"""megatron_zeropp/mcore/: the one place that touches megatron-core's private API, and the
supported-version gate.

The scan below reads every Python file of the project outside the adapter and flags any use of a
name that megatron-core itself marks private (an underscore name it defines), whether imported or
reached as an attribute; the names come from the installed megatron-core's own source, so a
private contact added anywhere else fails here on either supported version.
"""

import ast
import os
import pathlib
import subprocess
import sys

import pytest
from packaging.specifiers import SpecifierSet

import megatron_zeropp
from megatron_zeropp.mcore import version

REPO = pathlib.Path(__file__).resolve().parents[1]
ADAPTER = REPO / "megatron_zeropp" / "mcore"
SCANNED = ["megatron_zeropp", "tools", "benchmarks", "pretrain_gpt.py"]


def _megatron_core_private_names() -> set:
    import megatron.core

    names = set()
    for path in pathlib.Path(megatron.core.__file__).parent.rglob("*.py"):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = node.name
            elif isinstance(node, ast.Assign) and len(node.targets) == 1 and \
                    isinstance(node.targets[0], ast.Name):
                name = node.targets[0].id
            else:
                continue
            if name.startswith("_") and not name.startswith("__"):
                names.add(name)
    return names


def own_names(sources) -> set:
    """Names this project defines itself (its own private helpers may share a name with one of
    megatron-core's without touching megatron-core): functions, classes, variables, and
    attributes of its own objects (``self.x = ...``, ``cls.x = ...``). An attribute assigned on
    anything else (``module._private = ...``) is not a definition: it may be megatron-core's."""
    names = set()
    for source in sources:
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and \
                    isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
    return names


_BY_NAME = {"getattr", "setattr", "hasattr", "delattr"}


VERSION_SWITCHES = {"at_least", "mcore_version"}  # only the adapter branches on the version


def private_uses(source: str, private: set, own: set):
    """(line, name) of every megatron-core private name ``source`` imports from megatron or
    reaches as an attribute (``obj._name``, or by name: ``getattr(obj, "_name")``), own names
    aside, and of every import of the adapter's version switches."""
    hits = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and "mcore" in (node.module or "").split("."):
            hits += [(node.lineno, a.name) for a in node.names if a.name in VERSION_SWITCHES]
        module = (node.module or "") if isinstance(node, ast.ImportFrom) else ""
        if module == "megatron" or module.startswith("megatron."):
            for part in module.split("."):
                if part.startswith("_") and not part.startswith("__"):
                    hits.append((node.lineno, module))
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    hits.append((node.lineno, alias.name))
        elif isinstance(node, ast.Attribute) and node.attr in private and node.attr not in own:
            hits.append((node.lineno, node.attr))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                node.func.id in _BY_NAME and len(node.args) >= 2 and \
                isinstance(node.args[1], ast.Constant) and node.args[1].value in private and \
                node.args[1].value not in own:
            hits.append((node.lineno, node.args[1].value))
    return hits


def _project_files():
    for entry in SCANNED:
        path = REPO / entry
        files = [path] if path.is_file() else sorted(path.rglob("*.py"))
        for f in files:
            if ADAPTER not in f.parents:
                yield f


def test_no_megatron_core_private_name_outside_the_adapter():
    private = _megatron_core_private_names()
    assert len(private) > 500  # megatron-core's own source was read
    files = list(_project_files())
    own = own_names(f.read_text(encoding="utf-8") for f in files)
    found = {}
    for f in files:
        hits = private_uses(f.read_text(encoding="utf-8"), private, own)
        if hits:
            found[str(f.relative_to(REPO))] = hits
    assert not found, f"megatron-core private API outside megatron_zeropp/mcore/: {found}"


def test_scan_flags_private_imports_and_attributes():
    # Negative control: the scan catches each kind of contact the adapter took in.
    private = _megatron_core_private_names()
    src = (
        "from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBuffer\n"
        "from megatron.core.distributed.data_parallel_base import _BaseDataParallel\n"
        "r = opt._get_model_param_range_map(p)\n"
        "opt._copy_main_params_to_model_params()\n"
        "from megatron_zeropp.mcore.version import at_least\n"
    )
    hits = private_uses(src, private, own=set())
    assert sorted(h[1] for h in hits) == sorted([
        "_ParamAndGradBuffer", "_BaseDataParallel", "_get_model_param_range_map",
        "_copy_main_params_to_model_params", "at_least"])
    # A private module variable of megatron-core set or read by name outside the adapter:
    # assigning it does not make it the project's own (the guard once counted it so).
    planted = ("from megatron.core.dist_checkpointing.strategies import filesystem_async\n"
               "filesystem_async._results_queue = None\n"
               "q = getattr(filesystem_async, '_results_queue', None)\n")
    hits = private_uses(planted, private, own=own_names([planted]))
    assert hits == [(2, "_results_queue"), (3, "_results_queue")], hits
    # ... while the project's own attribute of the same kind of name is not flagged.
    mine = "class A:\n    def f(self):\n        self._results_queue = 1\n        " \
           "return self._results_queue\n"
    assert private_uses(mine, private, own=own_names([mine])) == []
    # ... and the adapter itself does contain them (it is where they live).
    adapter = "".join(p.read_text() for p in ADAPTER.glob("*.py"))
    assert private_uses(adapter, private, own=set())


@pytest.fixture
def installed(monkeypatch):
    def set_version(text):
        monkeypatch.setattr(version, "_installed_text", lambda: text)
        version.mcore_version.cache_clear()

    yield set_version
    version.mcore_version.cache_clear()


@pytest.mark.parametrize("release", version.SUPPORTED, ids=lambda r: r.version)
def test_supported_versions_pass(installed, monkeypatch, release):
    monkeypatch.delenv(version.ALLOW_ENV, raising=False)
    installed(release.version)
    assert version.check_supported() == version._parse(release.version)


# Registry releases between the supported ones, the hand-built 0.19.1 earlier CI tested, the
# next patch and minor releases, and a release candidate of a supported one.
@pytest.mark.parametrize("text", ["0.16.0", "0.17.0", "0.18.0", "0.18.1", "0.19.0", "0.19.1",
                                  "0.19.3", "0.20.0", "1.0.0"])
def test_untested_versions_are_refused_in_one_line(installed, monkeypatch, text):
    monkeypatch.delenv(version.ALLOW_ENV, raising=False)
    installed(text)
    with pytest.raises(version.UnsupportedMegatronCore) as err:
        version.check_supported()
    message = str(err.value)
    assert "\n" not in message
    assert f"installed: {text}," in message
    assert "supports megatron-core 0.16.1, 0.17.1, 0.18.2, 0.19.2;" in message
    assert version.ALLOW_ENV in message


def test_without_megatron_core_the_kernels_still_import(installed, monkeypatch):
    # The quantization kernels and collectives need no megatron-core (bench_kernels.py on a GPU
    # host without it); what does need it fails at its own import.
    def missing():
        raise version.MegatronCoreMissing("megatron-core is not installed")

    monkeypatch.setattr(version, "_installed_text", missing)
    version.mcore_version.cache_clear()
    assert version.check_supported() is None
    with pytest.raises(version.MegatronCoreMissing):
        version.check_supported(require=True)


def test_override_warns_and_runs(installed, monkeypatch):
    monkeypatch.setenv(version.ALLOW_ENV, "1")
    installed("0.18.0")
    with pytest.warns(UserWarning, match="0.18.0 is untested"):
        assert version.check_supported() == (0, 18, 0)


def test_unsupported_megatron_core_stops_pretrain_gpt_in_one_line(tmp_path):
    # A real start: a megatron-core 0.18.0 distribution found first on the path.
    info = tmp_path / "megatron_core-0.18.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: megatron-core\nVersion: 0.18.0\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(REPO)]))
    env.pop(version.ALLOW_ENV, None)
    out = subprocess.run([sys.executable, str(REPO / "pretrain_gpt.py"), "--help"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    lines = out.stderr.strip().splitlines()
    assert lines == [f"pretrain_gpt.py: megatron-zeropp supports megatron-core 0.16.1, 0.17.1, "
                     f"0.18.2, 0.19.2; installed: 0.18.0, which CI has not tested (set "
                     f"{version.ALLOW_ENV}=1 to run it anyway)"]


def pyproject_disagreement(text: str) -> list:
    """How ``pyproject.toml``'s text disagrees with :data:`version.SUPPORTED` (empty: agrees)."""
    import re

    found = re.findall(r'"(megatron-core[^"]*)"', text)
    if found != [version.pip_requirement()]:
        return [f"megatron-core requirement {found}, generated: {version.pip_requirement()}"]
    spec = SpecifierSet(found[0][len("megatron-core"):])
    # Every registry release up to the next minor (pip index versions megatron-core,
    # Python 3.11 and 3.12), the hand-built 0.19.1, and the next patch and minor releases.
    probes = ["0.15.3", "0.16.0", "0.16.1", "0.17.0", "0.17.1", "0.18.0", "0.18.1", "0.18.2",
              "0.19.0", "0.19.1", "0.19.2", "0.19.3", "0.20.0"]
    return [f"pip takes {v}: {v in spec}, the gate: {version.is_supported(version._parse(v))}"
            for v in probes if (v in spec) != version.is_supported(version._parse(v))]


def readme_disagreement(text: str) -> list:
    """How the README's "Supported versions" section disagrees with :data:`version.SUPPORTED`:
    the megatron-core versions it names in bold must be exactly the table's."""
    import re

    section = text.split("\n## Supported versions\n", 1)[1].split("\n## ", 1)[0]
    named = re.findall(r"\*\*(\d+\.\d+\.\d+)\*\*", section)
    table = [r.version for r in version.SUPPORTED]
    return [] if named == table else [f"README names {named}, the table {table}"]


def test_pyproject_and_readme_state_the_supported_table():
    import re

    text = (REPO / "pyproject.toml").read_text()
    assert pyproject_disagreement(text) == []
    assert readme_disagreement((REPO / "README.md").read_text()) == []
    python = SpecifierSet(re.search(r'requires-python = "([^"]+)"', text).group(1))
    assert all(r.python in python for r in version.SUPPORTED)
    assert all(v in python for v in ("3.10", "3.11", "3.12"))
    assert "3.13" not in python and "3.9" not in python


def test_a_disagreeing_pyproject_or_readme_is_caught():
    # Negative controls: the old range (0.19.x, 0.17 and 0.18 refused), a requirement that
    # lets 0.19.0 through, and a README naming a version the table lacks.
    old = '"megatron-core>=0.16.1,!=0.17.*,!=0.18.*,<0.20",'
    assert pyproject_disagreement(old)
    loose = f'"{version.pip_requirement().replace(",!=0.19.0", "")}"'
    assert pyproject_disagreement(loose)
    readme = (REPO / "README.md").read_text()
    assert readme_disagreement(readme.replace("**0.18.2**", "**0.18.0**"))
    assert readme_disagreement(readme.replace("**0.17.1**", "0.17.1"))


def test_the_generated_requirement_is_the_table():
    requirement = version.pip_requirement()
    assert requirement == ("megatron-core>=0.16.1,<=0.19.2,!=0.17.0,!=0.18.0,!=0.18.1,"
                           "!=0.19.0,!=0.19.1")
    assert not pyproject_disagreement(f'"{requirement}"')
    assert "0.17.1" in SpecifierSet(requirement[len("megatron-core"):])


def test_this_process_runs_a_supported_version():
    assert version.is_supported(version.mcore_version())
    assert megatron_zeropp.__version__
