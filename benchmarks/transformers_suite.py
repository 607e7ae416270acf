"""transformers' own modeling tests for every MoE family hpmoe knows, plain and with hpmoe blocks.

    python benchmarks/transformers_suite.py --sdist transformers-5.24.0.tar.gz \\
        --repo /path/to/transformers [--rev REV] [--families mixtral qwen3_moe ...] [-- PYTEST ARGS]

``--repo``: a checkout, a bare git dir (read at ``--rev``, default HEAD) or a plain directory
laid out like the repo (``tests/...``, ``utils/test_module/...``, ``src/transformers/testing_utils.py``).

Plan:
  1. Pick the families: ``--families``, default every family of ``hpmoe.nn.families.FAMILIES``
     whose test file ``tests/models/<name>/test_modeling_<name>.py`` is in ``--repo``; a family
     without one is reported as such and not run.
  2. Assemble a test tree in ``--workdir``: those test files and the helpers the sdist does not
     ship (``causal_lm_tester.py``, ``multimodal_tester.py``, ``vlm_tester.py``,
     ``generation/test_utils.py``, ``exporters/test_export.py``,
     ``utils/test_configuration_utils.py``) from ``--repo``, then every ``tests/*.py`` of the
     sdist over them (the installed version's common tests win).  ``src/transformers`` links to
     the installed package.  A helper that neither holds is written as a stub that skips
     (``run_distributed``: tensor-parallel and FSDP tests need several processes).  Names the
     tree imports from ``transformers.testing_utils`` that the installed version lacks (a
     ``--repo`` newer or older than it) are read as literals from ``--repo``'s
     ``src/transformers/testing_utils.py`` and set by the conftest.
  3. Write a ``conftest.py`` that, when ``HPMOE_SUITE_REPLACE=1``, wraps
     ``PreTrainedModel.post_init`` to call ``hpmoe.replace_moe_blocks`` on every model the
     tests build that holds a block of a family hpmoe does not refuse (``--virtual-ep`` ranks in
     one process where ``read_block`` accepts them for every block, else 1; ``--path taskflow``,
     the default, makes every region run the tile taskflow, ``--path auto`` keeps the layers'
     default, AUTO).  A model whose blocks are refused (``Family.refused``, or
     ``replace_moe_blocks`` raising ``ValueError``) is left in place and counted with the
     reason, so a refusal never turns into a failing test.  Models, regions and refusals are
     counted per family (the test file that built them).
  4. Run pytest twice (plain, hpmoe) offline (``HF_HUB_OFFLINE=1``: tests that need the
     network fail or skip in both runs alike) and read each run's JUnit XML.
  5. Print per family the counts of both runs, the tests passing in one run only, the models
     built with hpmoe blocks, the region calls and the models left in place, then every test
     whose outcome differs.

transformers' test files are Apache-2.0; they are read from the given paths, not vendored.
Exit status 1 when some test passes only without hpmoe.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import xml.etree.ElementTree as ET
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import transformers

from hpmoe.machine import record
from hpmoe.nn.families import FAMILIES

ROOT = Path(__file__).resolve().parents[1]
Reader = Callable[[str], bytes | None]  # a repo path -> its bytes, or None where absent
NAMES = tuple(f.name for f in FAMILIES)
OUTCOMES = ("passed", "failed", "skipped")
HELPERS = (
    "tests/__init__.py",
    "tests/causal_lm_tester.py",
    "tests/multimodal_tester.py",
    "tests/vlm_tester.py",
    "tests/generation/__init__.py",
    "tests/generation/test_utils.py",
    "tests/exporters/__init__.py",
    "tests/exporters/test_export.py",
    "tests/utils/__init__.py",
    "tests/utils/test_configuration_utils.py",
    "tests/utils/tiny_model_summary.json",
    "tests/models/__init__.py",
    "utils/test_module/__init__.py",
    "utils/test_module/custom_configuration.py",
)
STUBS = {
    "tests/distributed_testing_utils.py": '''"""Stub: multi-process tests are out of this suite's scope."""
import unittest


def _skip(*args, **kwargs):
    raise unittest.SkipTest("multi-process test (distributed_testing_utils is not available)")


def run_distributed(*args, **kwargs):
    return lambda fn: _skip


def __getattr__(name):
    return _skip
''',
}
CONFTEST = '''"""Written by hpmoe's benchmarks/transformers_suite.py."""
import json
import os

MARKERS = ("flash_attn_test", "flash_attn_3_test", "torch_compile_test", "torch_export_test",
           "generate", "is_training_test", "is_tensor_parallel_test", "training_ci",
           "bitsandbytes", "not_device_test", "is_staging_test", "is_pipeline_test", "timeout",
           "executorch_export_test", "flash_attn_4_test", "fsdp_test")


def pytest_configure(config):
    for marker in MARKERS:
        config.addinivalue_line("markers", marker)


def _add_testing_utils():
    """Give transformers.testing_utils the names the helpers import that the installed version
    lacks (their values read from --repo's testing_utils.py by the suite)."""
    path = os.path.join(os.path.dirname(__file__), "testing_utils_extra.json")
    if os.path.exists(path):
        import transformers.testing_utils as installed

        with open(path) as f:
            for name, value in json.load(f).items():
                setattr(installed, name, value)


_add_testing_utils()


if os.environ.get("HPMOE_SUITE_REPLACE") == "1":
    import weakref

    from transformers import PreTrainedModel

    from hpmoe.nn.families import family_of, read_block
    from hpmoe.nn.replace import replace_moe_blocks

    _post_init = PreTrainedModel.post_init
    VIRTUAL_EP = int(os.environ.get("HPMOE_SUITE_VIRTUAL_EP", "2"))
    # "taskflow": every region runs the tile taskflow (schedule None); "auto": the default
    SCHEDULE = {"taskflow": {"schedule": None}, "auto": {}}[os.environ.get("HPMOE_SUITE_PATH", "taskflow")]
    # per family (the test file running): models built with hpmoe blocks, eager MoE.region
    # calls, models left in place {reason: count}
    COUNTS = {}
    CURRENT = {"family": "(collection)"}
    SEEN = weakref.WeakSet()  # blocks already counted: a wrapper model's post_init follows its inner one's

    def pytest_runtest_setup(item):
        parts = item.nodeid.split("/")
        CURRENT["family"] = parts[2] if parts[:2] == ["tests", "models"] else "(other)"

    def _counts():
        return COUNTS.setdefault(CURRENT["family"], {"models": 0, "regions": 0, "left_in_place": {}})

    def _leave(reason):
        left = _counts()["left_in_place"]
        left[reason] = left.get(reason, 0) + 1

    def _virtual_ep(blocks):
        """VIRTUAL_EP where read_block accepts it for every block (it must divide the
        experts: test_load_balancing_loss has 3), else 1."""
        try:
            for block in blocks:
                read_block(block, family_of(block), VIRTUAL_EP)
        except ValueError:
            return 1
        return VIRTUAL_EP

    def post_init(self):
        _post_init(self)
        blocks = [m for m in self.modules() if family_of(m) is not None and m not in SEEN]
        if not blocks:
            return
        SEEN.update(blocks)
        supported = [b for b in blocks if not family_of(b).refused]
        if not supported:
            fam = family_of(blocks[0])
            _leave(f"{fam.name} refused: {fam.refused}")
            return
        try:
            replace_moe_blocks(self, virtual_ep=_virtual_ep(supported), **SCHEDULE)
        except ValueError as e:  # a refusal is reported, never a failing test
            _leave(str(e))
            return
        _counts()["models"] += 1

    PreTrainedModel.post_init = post_init

    import torch

    from hpmoe.nn.layer import MoE

    _region = MoE.region

    def counted_region(self, *args, **kwargs):
        if not torch.compiler.is_compiling():  # a counter in a compiled graph makes it recompile
            _counts()["regions"] += 1
        return _region(self, *args, **kwargs)

    MoE.region = counted_region

    def pytest_sessionfinish(session):
        path = os.environ.get("HPMOE_SUITE_COUNTS")
        if path:
            with open(path, "w") as f:
                json.dump(COUNTS, f, indent=1)
'''


def family_tests(family: str) -> str:
    """The repo path of a family's modeling tests (the family's name is its model_type)."""
    return f"tests/models/{family}/test_modeling_{family}.py"


def repo_files(families: list[str]) -> tuple[str, ...]:
    """What the tree takes from ``--repo``: the helpers and each family's test file."""
    return (*HELPERS, *(p for f in families for p in (f"tests/models/{f}/__init__.py", family_tests(f))))


def _repo_reader(repo: Path, rev: str) -> Reader:
    """A function path -> bytes | None reading a checkout or a (bare) git dir at ``rev``."""
    git_dir = repo if (repo / "objects").is_dir() else repo / ".git"
    if not git_dir.is_dir():
        return lambda p: (repo / p).read_bytes() if (repo / p).is_file() else None

    def read(p: str) -> bytes | None:
        r = subprocess.run(["git", f"--git-dir={git_dir}", "show", f"{rev}:{p}"], capture_output=True)
        return r.stdout if r.returncode == 0 else None

    return read


def _sdist_tests(sdist: Path, into: Path) -> Path:
    """The sdist's ``tests`` directory (extracting a .tar.gz under ``into``)."""
    if sdist.is_dir():
        return sdist / "tests"
    with tarfile.open(sdist) as tar:
        tar.extractall(into, filter="data")
    return next(into.glob("transformers-*/tests"))


def _literals(source: bytes, names: set[str]) -> dict:
    """The module-level ``NAME = <literal>`` assignments of ``source`` among ``names``."""
    found = {}
    for node in ast.parse(source).body:
        target = node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else None
        if isinstance(target, ast.Name) and target.id in names:
            with contextlib.suppress(ValueError):
                found[target.id] = ast.literal_eval(node.value)
    return found


def testing_utils_extra(tree: Path, read: Reader) -> dict:
    """What the tree's files import from ``transformers.testing_utils`` that the installed
    version lacks (``--repo`` newer or older than it), as literals from ``--repo``'s
    ``src/transformers/testing_utils.py``; the conftest sets them (plan step 2)."""
    import transformers.testing_utils as installed

    wanted = set()
    for f in tree.glob("tests/**/*.py"):
        for node in ast.walk(ast.parse(f.read_bytes())):
            if isinstance(node, ast.ImportFrom) and node.module == "transformers.testing_utils":
                wanted |= {a.name for a in node.names if not hasattr(installed, a.name)}
    source = read("src/transformers/testing_utils.py") if wanted else None
    return _literals(source, wanted) if source else {}


def assemble(sdist: Path, read: Reader, families: list[str], work: Path) -> Path:
    """Build the test tree (plan steps 2-3); returns its root."""
    tree = work / "tree"
    shutil.rmtree(tree, ignore_errors=True)
    for rel in repo_files(families):
        data = read(rel)
        if data is None and rel.endswith("__init__.py"):
            data = b""
        if data is None:
            raise SystemExit(f"{rel} is not in --repo")
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        (tree / rel).write_bytes(data)
    for f in _sdist_tests(sdist, work / "sdist").glob("*.py"):
        shutil.copy(f, tree / "tests" / f.name)
    for rel, text in STUBS.items():
        if not (tree / rel).exists():
            (tree / rel).write_text(text)
    (tree / "conftest.py").write_text(CONFTEST)
    extra = testing_utils_extra(tree, read)
    if extra:
        print(f"from --repo's testing_utils.py (the installed one lacks them): {' '.join(extra)}")
        (tree / "testing_utils_extra.json").write_text(json.dumps(extra, indent=1))
    (tree / "src").mkdir()  # test_pipeline_mixin reads src/transformers: the installed package
    (tree / "src" / "transformers").symlink_to(Path(transformers.__file__).parent)
    return tree


def run(tree: Path, families: list[str], replace: bool, a: argparse.Namespace) -> dict[str, str]:
    """One pytest run over the families' test files; {test id: passed | failed | skipped}."""
    xml = tree / f"junit-{'hpmoe' if replace else 'plain'}.xml"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HPMOE_SUITE_REPLACE": "1" if replace else "0", "HPMOE_SUITE_VIRTUAL_EP": str(a.virtual_ep),
           "HPMOE_SUITE_PATH": a.path, "HPMOE_SUITE_COUNTS": str(tree / "hpmoe-counts.json"),
           "PYTHONPATH": os.pathsep.join([str(tree), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tree),
           f"--junitxml={xml}", "-o", "junit_family=xunit1", *map(family_tests, families), *a.pytest_args]
    subprocess.run(cmd, cwd=tree, env=env, stdout=subprocess.DEVNULL)
    return outcomes(xml)


def outcomes(xml: Path) -> dict[str, str]:
    result = {}
    for case in ET.parse(xml).iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        kinds = {child.tag for child in case}
        result[name] = ("failed" if kinds & {"failure", "error"}
                        else "skipped" if "skipped" in kinds else "passed")
    return result


def family_of_test(test: str) -> str:
    """``tests.models.<family>.test_modeling_<family>.Class::name`` -> ``<family>``."""
    parts = test.split("::")[0].split(".")
    return parts[2] if parts[:2] == ["tests", "models"] and len(parts) > 2 else "(other)"


def differences(plain: dict[str, str], hp: dict[str, str]) -> dict[str, list[str]]:
    """Tests passing only without hpmoe, only with it, and other outcome differences."""
    only_plain = sorted(t for t, o in plain.items() if o == "passed" and hp.get(t) != "passed")
    only_hp = sorted(t for t, o in hp.items() if o == "passed" and plain.get(t) != "passed")
    other = sorted(t for t in plain.keys() | hp.keys()
                   if plain.get(t) != hp.get(t) and t not in only_plain and t not in only_hp)
    return {"passes only without hpmoe": only_plain, "passes only with hpmoe": only_hp,
            "other differences": other}


def outcome_counts(res: dict[str, str]) -> dict[str, int]:
    c = Counter(res.values())
    return {k: c[k] for k in OUTCOMES}


def family_rows(plain: dict[str, str], hp: dict[str, str], counts: dict, families: list[str]) -> dict:
    """Per family: each run's outcome counts, the differences' sizes and the hpmoe run's counts."""
    rows = {}
    for fam in families:
        mine, hp_mine = ({t: o for t, o in res.items() if family_of_test(t) == fam} for res in (plain, hp))
        rows[fam] = {"plain": outcome_counts(mine), "hpmoe": outcome_counts(hp_mine),
                     **{k: len(v) for k, v in differences(mine, hp_mine).items()},
                     "models": 0, "regions": 0, "left_in_place": {}, **counts.get(fam, {})}
    return rows


def print_rows(rows: dict) -> None:
    """The per-family table, then each family's models left in place and why."""
    print(f"{'family':17s} {'plain p/f/s':>14s} {'hpmoe p/f/s':>14s} {'only plain':>10s} {'only hpmoe':>10s} "
          f"{'models':>7s} {'regions':>8s} {'left':>5s}")
    for fam, r in rows.items():
        pfs = ["/".join(str(r[m][k]) for k in OUTCOMES) for m in ("plain", "hpmoe")]
        print(f"{fam:17s} {pfs[0]:>14s} {pfs[1]:>14s} {r['passes only without hpmoe']:10d} "
              f"{r['passes only with hpmoe']:10d} {r['models']:7d} {r['regions']:8d} "
              f"{sum(r['left_in_place'].values()):5d}")
    for fam, r in rows.items():
        for reason, n in r["left_in_place"].items():
            print(f"  {fam}: {n} models left in place ({reason})")


def report(plain: dict[str, str], hp: dict[str, str]) -> list[str]:
    """Print the overall counts and the differences; returns the tests passing only without hpmoe."""
    print(f"\n{'mode':8s} {'passed':>7s} {'failed':>7s} {'skipped':>8s}")
    for mode, res in (("plain", plain), ("hpmoe", hp)):
        c = outcome_counts(res)
        print(f"{mode:8s} {c['passed']:7d} {c['failed']:7d} {c['skipped']:8d}")
    diffs = differences(plain, hp)
    for title, tests in diffs.items():
        print(f"\n{title}: {len(tests)}")
        for t in tests:
            print(f"  {t}: plain {plain.get(t, 'absent')}, hpmoe {hp.get(t, 'absent')}")
    return diffs["passes only without hpmoe"]


def pick_families(asked: list[str] | None, read: Reader) -> tuple[list[str], list[str]]:
    """(families to run, families without a test file in --repo), in FAMILIES order."""
    names = [n for n in NAMES if asked is None or n in asked]
    present = [n for n in names if read(family_tests(n)) is not None]
    return present, [n for n in names if n not in present]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sdist", type=Path, required=True, help="transformers sdist (.tar.gz or extracted)")
    p.add_argument("--repo", type=Path, required=True, help="transformers checkout, git dir or test tree")
    p.add_argument("--rev", default="HEAD", help="revision of --repo (git only)")
    p.add_argument("--families", nargs="+", choices=NAMES, default=None, metavar="FAMILY",
                   help="hpmoe families (transformers model types); default: every one with a test file")
    p.add_argument("--workdir", type=Path, default=None, help="where to build the tree (default: temp)")
    p.add_argument("--virtual-ep", type=int, default=2, help="virtual EP ranks of the hpmoe layers")
    p.add_argument("--path", choices=("taskflow", "auto"), default="taskflow",
                   help="hpmoe regions: always the tile taskflow, or the layers' default (AUTO)")
    p.add_argument("--json", type=Path, default=None,
                   help="write {families: {family: counts}, tests: {test: [plain, hpmoe]}} here")
    p.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    a = p.parse_args()
    record()
    read = _repo_reader(a.repo, a.rev)
    families, missing = pick_families(a.families, read)
    print(f"families: {' '.join(families)}\nwithout a test file: {' '.join(missing) or 'none'}", flush=True)
    if not families:
        raise SystemExit("no family to run")
    work = a.workdir or Path(tempfile.mkdtemp(prefix="hpmoe-hfsuite-"))
    tree = assemble(a.sdist, read, families, work)
    plain = run(tree, families, False, a)
    hp = run(tree, families, True, a)
    counts_file = tree / "hpmoe-counts.json"  # absent when the hpmoe run ended before its session did
    counts = json.loads(counts_file.read_text()) if counts_file.exists() else {}
    rows = family_rows(plain, hp, counts, families)
    print_rows(rows)
    only_plain = report(plain, hp)
    if a.json:
        tests = {t: [plain.get(t), hp.get(t)] for t in sorted(plain.keys() | hp.keys())}
        a.json.write_text(json.dumps({"families": rows, "tests": tests}, indent=1))
    return 1 if only_plain else 0


if __name__ == "__main__":
    sys.exit(main())
