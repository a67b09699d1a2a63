"""The design card's boundary: `client/` and `shared/` never import MLX, not even
inside a function (commands that need a model import `moestream.daemon` there)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _mlx_imports(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = (
            [a.name for a in node.names]
            if isinstance(node, ast.Import)
            else [node.module or ""]
            if isinstance(node, ast.ImportFrom)
            else []
        )
        found += [f"{path.relative_to(ROOT)}:{node.lineno} {n}" for n in names if n.split(".")[0] in ("mlx", "mlx_lm")]
    return found


@pytest.mark.parametrize("folder", ["client", "shared"])
def test_no_mlx_import_in(folder):
    files = sorted((ROOT / folder).rglob("*.py"))
    assert files
    bad = [hit for f in files for hit in _mlx_imports(f)]
    assert bad == [], f"{folder}/ imports MLX: {bad}"


def test_nothing_reads_a_folder_beside_the_checkout():
    """A user's clone is the whole project: no code or test reaches for `../shared` or
    another folder outside the repository (the traces the tests need are in tests/data)."""
    outside = ("../shared", "/work/shared", 'parents[2] / "shared"')
    files = [
        f
        for top in ("client", "daemon", "shared", "native", "tests")
        for f in (ROOT / top).rglob("*")
        if f.suffix in (".py", ".cpp", ".h") and f.is_file()
    ]
    assert files
    this = Path(__file__).resolve()
    bad = [f"{f.relative_to(ROOT)}: {s}" for f in files if f.resolve() != this for s in outside if s in f.read_text()]
    assert bad == [], bad


def _code_files(*tops: str, suffixes: tuple[str, ...] = (".py",)) -> list[Path]:
    return sorted(
        f for top in tops for f in (ROOT / top).rglob("*") if f.suffix in suffixes and "__pycache__" not in f.parts
    )


def test_the_maintainers_map_names_every_module():
    """daemon/README.md maps the code: every module of the package is named there, by its
    path or by a folder row that covers it."""
    text = (ROOT / "daemon" / "README.md").read_text()
    missing = []
    for f in _code_files("daemon", "client", "shared", "native", suffixes=(".py", ".cpp", ".h")):
        rel = f.relative_to(ROOT)
        if f.name == "__init__.py" or "demo" in rel.parts and "store" in rel.parts:
            continue
        folders = [str(p) + "/" for p in rel.parents if str(p) != "."]
        named = f"`{rel}`" in text or f.stem in text or any(f"`{d}`" in text for d in folders[:-1])
        if not named:
            missing.append(str(rel))
    assert missing == [], f"daemon/README.md does not name {missing}"


def test_no_benchmark_soak_or_command_module_beside_engine_code():
    """Benchmarks live under daemon/bench/ and commands under client/cli/, not beside the
    engine's modules under names like bench_*.py, soak_*.py or cmd_*.py."""
    bad = [
        str(f.relative_to(ROOT))
        for f in _code_files("daemon", "client", "shared")
        if f.name.startswith(("bench_", "soak_", "cmd_"))
    ]
    assert bad == []


def test_code_says_why_and_leaves_the_history_to_the_results():
    """Measurements and the runs that made them belong in tests/bench/RESULTS.md, not in
    code: no comment or docstring names a session of work."""
    pattern = re.compile(r"\bsessions? \d+", re.IGNORECASE)
    files = _code_files("daemon", "client", "shared", "native", "tests", suffixes=(".py", ".cpp", ".h", ".sh"))
    bad = [
        f"{f.relative_to(ROOT)}:{i}"
        for f in files
        for i, line in enumerate(f.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert bad == [], bad


# What code may assign on an object that is not `self`/`cls`: fields of plain records the
# function owns or fills (results, statistics, jobs), and a few objects of the standard
# library or of the function's own making. A collaborator or a switch of another
# module's object is set through a method of its owner (`Diagnostics.recording`,
# `Prefetcher.switch`, `StreamingModel.mtp_head`), never assigned from outside.
# (variable, attribute): why; "*" takes any field of that record.
ASSIGNMENT_ALLOWED = {
    ("job", "*"): "the engine loop's own `Job` record of one request",
    ("st", "*"): "the heat keeper's own `KeeperStats`",
    ("tally", "*"): "the soak driver's `SoakTally`",
    ("counts", "*"): "a policy replay's `ReplayCounts`",
    ("result", "*"): "a `GenerationResult` the generation loop fills",
    ("stats", "*"): "a request's `SpeculativeStats` / `PrefillStats` the loop fills",
    ("entry", "state"): "the prefetcher's own buffer `_Entry`",
    ("layer", "union"): "a `LayerDiagnostics` record of the recorder that holds it",
    ("prediction", "submitted"): "a `Prediction` record: the layer that submitted its reads says so",
    ("prediction", "submitted_at"): "the same record's submit time",
    ("view", "*"): "prefill.py's own shallow copy of a cache (`_Early`): its offset shifted for a mask, its methods "
    "wrapped to be called again on the real cache",
    ("KeepMTP", "__name__"): "a class the function itself defines, named like the one it extends",
    ("log", "propagate"): "the standard library's Logger is configured through its attributes",
    ("node", "*"): "prompt_tree.py's own `Node` records, changed by the tree that owns them",
    ("upper", "*"): "the same, the upper half of a split segment",
    ("parent", "children"): "the same, a split segment's parent",
    ("up", "end"): "the same, an ancestor that is no longer an entry",
    ("n", "used"): "the same, a served path's nodes marked used",
    ("own", "disk"): "prompt_cache.py's own `_Scope` record of one scope's files",
    ("c", "state"): "mlx-lm's cache objects take their contents through their `state` property",
    ("Shown", "__name__"): "a class the function itself defines, named like the one it extends",
    ("SplitAttention", "__name__"): "the same, convert's kimi_vl class that splits its attention",
    ("model", "<setattr>"): "vision.py's own mlx-vlm model, built the line before: a tower the store has no "
    "weights of is unset before any weight loads, as mlx-vlm's own load does",
    ("processor", "image_processor"): "vision.py's own Llama 4 processor, just loaded: one tile an image (mlx-vlm "
    "0.7's tiles lack their global tile; see the comment there)",
    ("plan", "fitted_to"): "plan.py's own `Plan` record, which the function that made it completes",
    ("bar", "note"): "pull.py's own progress line, the file it is on",
    ("state", "crcs"): "pull.py's own `PullState` record, saved after each file",
    ("now", "*"): "optimistic.py's own `_Forward` record of the decode forward it runs",
    # Known exception: the model's own cache-keeping modules are run per request by
    # switching their class to a subclass whose call splits the batch (row_batch.py);
    # nothing else of the module changes, and no copy of mlx-lm's attention is needed.
    # The same for the decoder blocks and the model whose calls optimistic.py replays.
    ("module", "__class__"): "known exception, see above",
    # To go: the CUDA copier's kernel switch is set after construction by make_admitter
    # (daemon/pool/admission.py); cuda_copier() should take it instead.
    ("copier", "kernel"): "known exception, see above",
}


def _assigned_on_others(source: str, name: str = "<source>") -> list[tuple[str, str, int]]:
    """(variable, first attribute, line) of every `NAME.attr... = `, `NAME.attr... += `,
    `NAME.attr[...] = ` and `setattr(NAME, ...)` whose NAME is not `self` or `cls`."""

    def base(node: ast.expr) -> tuple[str, str] | None:
        if isinstance(node, ast.Subscript):
            node = node.value
            if not isinstance(node, ast.Attribute):
                return None  # `d[k] = v` on a plain container
        if not isinstance(node, ast.Attribute):
            return None
        attrs = []
        while isinstance(node, ast.Attribute):
            attrs.append(node.attr)
            node = node.value
        if isinstance(node, ast.Name) and node.id not in ("self", "cls"):
            return node.id, attrs[-1]
        return None

    def flat(targets: list[ast.expr]):
        for t in targets:
            if isinstance(t, (ast.Tuple, ast.List)):
                yield from flat(t.elts)
            elif isinstance(t, ast.Starred):
                yield from flat([t.value])
            else:
                yield t

    found = []
    for node in ast.walk(ast.parse(source, name)):
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "setattr"
            and node.args
            and isinstance(node.args[0], ast.Name)
            and node.args[0].id not in ("self", "cls")
        ):
            found.append((node.args[0].id, "<setattr>", node.lineno))
            continue
        else:
            continue
        for t in flat(targets):
            hit = base(t)
            if hit is not None:
                found.append((*hit, node.lineno))
    return found


def _allowed(var: str, attr: str) -> bool:
    return (var, attr) in ASSIGNMENT_ALLOWED or (var, "*") in ASSIGNMENT_ALLOWED


def test_the_wiring_scan_flags_an_attribute_set_on_another_object():
    planted = "def f(sm, pf, hub):\n    sm.mtp = 1\n    pf.governor, x = 2, 3\n    hub.rec.x += 1\n"
    planted += "    sm.draft_models['k'] = 4\n    setattr(sm, 'a', 5)\n    self.ok = 6\n    d['k'] = 7\n"
    found = _assigned_on_others(planted)
    assert [(v, a) for v, a, _ in found] == [
        ("sm", "mtp"),
        ("pf", "governor"),
        ("hub", "rec"),
        ("sm", "draft_models"),
        ("sm", "<setattr>"),
    ]
    assert not any(_allowed(v, a) for v, a, _ in found)
    assert _allowed("job", "gen") and _allowed("layer", "union")


def test_no_module_wires_another_modules_object_by_assignment():
    """Collaborators and switches are handed over at construction or through a method of
    the object's owner, so that whoever reads the object finds every way it changes in
    its own class; assigning them from outside ("wiring by mutation") hides that. Only
    fields of plain records (ASSIGNMENT_ALLOWED) are assigned from outside."""
    seen, bad = set(), []
    for f in _code_files("daemon", "client", "shared"):
        for var, attr, line in _assigned_on_others(f.read_text(), str(f)):
            key = (var, attr) if (var, attr) in ASSIGNMENT_ALLOWED else (var, "*")
            if key in ASSIGNMENT_ALLOWED:
                seen.add(key)
            else:
                bad.append(f"{f.relative_to(ROOT)}:{line} {var}.{attr}")
    assert bad == [], f"attributes assigned on another module's object: {bad}"
    # An entry nothing needs any more goes, so that the list stays the short list of records.
    assert set(ASSIGNMENT_ALLOWED) - seen == set()


def test_pool_counters_are_listed_once_by_their_dataclasses():
    """A counter added to `PoolStats` (or `MappedPoolStats`) is summed by `pool_stats` and
    taken per request without being named again: the lists come from the dataclasses'
    fields, and no module spells a list of them out by hand."""
    from dataclasses import dataclass, fields

    from moestream.daemon.mapped.mapped_pool import MappedPoolStats
    from moestream.daemon.model.streaming_model import PLACEMENT_COUNTERS, POOL_COUNTERS, counter_fields
    from moestream.daemon.pool.expert_pool import PoolStats
    from moestream.shared.status import PoolCounters, PoolTotals

    @dataclass
    class Grown(PoolStats):
        added: int = 0
        added_seconds: float = 0.0

    assert counter_fields(Grown) == (*POOL_COUNTERS, "added", "added_seconds")
    assert "routed" not in POOL_COUNTERS  # the per-expert array for heat
    assert {"hits_prefill", "misses_decode", "bytes_read", "routed_total"} <= set(POOL_COUNTERS)
    assert PLACEMENT_COUNTERS == tuple(f.name for f in fields(MappedPoolStats))
    # One definition of the counters: each layer's (`PoolStats`) and `stats`' sums of them.
    assert issubclass(PoolStats, PoolCounters) and issubclass(PoolTotals, PoolCounters)
    assert counter_fields(PoolCounters) == POOL_COUNTERS
    by_hand = []
    for f in _code_files("daemon", "client", "shared"):
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
                names = [e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
                for counters in (POOL_COUNTERS, PLACEMENT_COUNTERS):
                    if len(names) >= 4 and set(names) <= set(counters):
                        by_hand.append(f"{f.relative_to(ROOT)}:{node.lineno}")
    assert by_hand == [], f"pool counters listed by hand: {by_hand}"


def test_imports_inside_the_package_are_relative():
    """As mlx-lm writes them: a tool that draws the import graph from the tree sees every
    arrow, and the package can be read without knowing the name it is installed under."""
    absolute = re.compile(r"^\s*(from moestream[\s.]|import moestream\b)")
    bad = [
        f"{f.relative_to(ROOT)}:{i}"
        for f in _code_files("daemon", "client", "shared")
        for i, line in enumerate(f.read_text().splitlines(), 1)
        if absolute.match(line)
    ]
    assert bad == [], f"absolute imports of the package inside it: {bad}"


def _import_graph() -> dict[str, set[str]]:
    """module -> the package's modules it imports, at any depth of its code (a function's
    own imports too; TYPE_CHECKING blocks left out), from the relative imports."""
    mods = {}
    for f in _code_files("daemon", "client", "shared"):
        rel = f.relative_to(ROOT).with_suffix("").parts
        name = ".".join(rel[:-1] if rel[-1] == "__init__" else rel)
        mods[name] = (f, rel[-1] == "__init__")
    graph: dict[str, set[str]] = {}
    for name, (f, is_pkg) in mods.items():
        package = name.split(".") if is_pkg else name.split(".")[:-1]
        out: set[str] = set()

        def visit(body: list[ast.stmt]) -> None:
            for node in body:
                if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                    continue
                if isinstance(node, ast.ImportFrom) and node.level:
                    base = ".".join(
                        [*package[: len(package) - node.level + 1], *([node.module] if node.module else [])]
                    )
                    for alias in node.names:
                        out.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in mods else base)
                for child in ast.iter_child_nodes(node):
                    if isinstance(child, ast.stmt):
                        visit([child])

        visit(ast.parse(f.read_text(), str(f)).body)
        graph[name] = {m for m in out if m in mods and m != name}
    return graph


def test_no_import_cycles_and_no_product_module_imports_a_benchmark():
    """Every arrow points one way, function-local imports included (they are where
    cycles hid), and no engine, client or shared module reaches into `daemon/bench`
    (benchmarks import the product, never the other way)."""
    graph = _import_graph()
    assert "daemon.model.generation" in graph and graph["client.gateway.ollama"]
    cycles, index, low, stack, on = [], {}, {}, [], set()

    def strong(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                on.discard(w)
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                cycles.append(sorted(part))

    for v in graph:
        if v not in index:
            strong(v)
    assert cycles == [], f"import cycles: {cycles}"
    bench = [f"{m} -> {t}" for m, ts in graph.items() for t in ts if t.startswith("daemon.bench") and ".bench" not in m]
    assert bench == [], f"product modules importing benchmarks: {bench}"
