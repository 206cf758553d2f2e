"""The manuals are executed: their runnable code blocks run, and every EDDIS name they mention exists.

Marking a block runnable: an HTML comment on the line right before a ```python fence,

    <!-- eddis: run -->           the block is a whole script; it runs alone in a fresh
                                  interpreter (one process: eddis.init() with no launcher)
    <!-- eddis: run ranks=2 -->   the same under ``eddis-train --local -n 2`` (test marked mpi)

A marked block runs in an empty temporary working directory and passes when it exits 0
within its time limit, so it states its own claims with ``assert``. Blocks that cannot run
alone (fragments of a loop, GPU-only code) stay unmarked; their names are still checked.

Checked names: every dotted name that starts with a name bound to EDDIS, in the python
code blocks and the inline code spans of docs/*.md. ``import eddis.torch as eddis`` (or
``as hvd``; in a code block or an inline span) binds the alias from that line on, and
before that line the doc's first binding holds; a doc that binds nothing reads
``eddis.X`` as the ``eddis`` package's, else as either adapter's (framework-neutral text
writes ``eddis.init()``). ``import horovod.torch as hvd`` binds ``hvd`` to Horovod: its
names are not EDDIS's and are skipped. A name resolves when the attribute chain exists
on the bound module (submodules are imported on the way), or when the whole name is an
importable module (``eddis.core.hetero.easgd``, whatever ``eddis`` is bound to). In a table
whose header's first cell is ``Horovod``, the first column names Horovod's API and is
not checked. The bare names a paragraph that starts "The names mean the same:" lists (Horovod's
API, as ``init`` or ``callbacks.MetricAverageCallback``) must exist on the module ``hvd`` is
bound to (``optimizer.`` names are methods and are left out). Dotted text inside a string literal is data (a logger's name, a module
path given to a tool), not a name. A name that does not resolve fails the test with manual, line and name.
"""
import importlib
import re
import subprocess

import pytest

from conftest import PYTHON, REPO, python_env, run_process_group

DOCS = sorted((REPO / "docs").glob("*.md"))
MARKER = re.compile(r"^<!--\s*eddis:\s*run(?P<options>(?:\s+\w+=\S+)*)\s*-->\s*$")
FENCE = re.compile(r"^(?P<indent>\s*)```(?P<lang>\S*)")
IMPORT_AS = re.compile(r"\bimport\s+(?P<module>[A-Za-z_][\w.]*)\s+as\s+(?P<alias>[A-Za-z_]\w*)")
IMPORT_FROM = re.compile(r"^\s*from\s+(?P<module>[A-Za-z_][\w.]*)\s+import\s+(?P<names>[\w\s,()]+)")
IMPORT_PLAIN = re.compile(r"^\s*import\s+(?P<modules>[A-Za-z_][\w.]*(?:\s*,\s*[A-Za-z_][\w.]*)*)\s*$")
DOTTED = re.compile(r"(?<![\w.])(?P<name>[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)")
STRING = re.compile(r"\"[^\"]*\"|'[^']*'")
INLINE = re.compile(r"(?<!`)`(?P<code>[^`\n]+)`(?!`)")
ADAPTERS = ("eddis.torch", "eddis.tensorflow")
BLOCK_TIMEOUT = 240  # seconds; a two-rank TensorFlow block imports TensorFlow twice on 2 cores


class Block:
    def __init__(self, doc, line, lang, text, options):
        self.doc, self.line, self.lang, self.text, self.options = doc, line, lang, text, options

    @property
    def ranks(self):
        return int(self.options.get("ranks", 1))

    def __repr__(self):
        return f"{self.doc.name}:{self.line}"


def parse(doc):
    """(code blocks, prose lines) of a markdown file; a block's line is its fence's, 1-based."""
    lines = doc.read_text().splitlines()
    blocks, prose = [], []
    i = 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if not fence:
            prose.append((i + 1, lines[i]))
            i += 1
            continue
        start, lang = i, fence.group("lang")
        marker = MARKER.match(lines[start - 1].strip()) if start else None
        options = dict(opt.split("=", 1) for opt in marker.group("options").split()) if marker else None
        i += 1
        body = []
        while i < len(lines) and not FENCE.match(lines[i]):
            body.append(lines[i][len(fence.group("indent")):])
            i += 1
        i += 1  # the closing fence
        blocks.append(Block(doc, start + 1, lang, "\n".join(body) + "\n", options))
    return blocks, prose


def runnable_blocks():
    found = []
    for doc in DOCS:
        for block in parse(doc)[0]:
            if block.options is not None:
                assert block.lang == "python", f"{block}: the run marker precedes a ```{block.lang} block"
                found.append(block)
    return found


def mentions(doc):
    """(line, code) of every python code line and inline code span, in the doc's order."""
    blocks, prose = parse(doc)
    prose_by_line = dict(prose)
    found = [(line, span.group("code")) for line, text in prose for span in INLINE.finditer(text)
             if not in_horovod_column(prose_by_line, line, span)]
    for block in blocks:
        if block.lang == "python":
            found += [(block.line + k + 1, code) for k, code in enumerate(block.text.splitlines())]
    return sorted(found, key=lambda item: item[0])


def in_horovod_column(prose_by_line, line, span):
    """Whether ``span`` sits in the first cell of a table row under a ``| Horovod |`` header."""
    text = prose_by_line[line]
    if not text.lstrip().startswith("|"):
        return False
    first_cell_end = text.find("|", text.index("|") + 1)
    if first_cell_end < 0 or span.start() > first_cell_end:
        return False
    top = line
    while prose_by_line.get(top - 1, "").lstrip().startswith("|"):
        top -= 1
    return prose_by_line[top].split("|")[1].strip() == "Horovod"


def lookup(module, attrs):
    """The object ``module.attrs[0]...`` (submodules imported on the way), or None."""
    try:
        obj = importlib.import_module(module)
    except ImportError:
        return None
    path = module
    for attr in attrs:
        path = f"{path}.{attr}"
        if hasattr(obj, attr):
            obj = getattr(obj, attr)
            continue
        try:
            obj = importlib.import_module(path)
        except ImportError:
            return None
    return obj


def is_module(dotted):
    try:
        importlib.import_module(dotted)
        return True
    except ImportError:
        return False


def bindings_in(doc_mentions):
    """[(line, alias, module)] of every ``import X as alias`` the doc shows, in order."""
    found = []
    for line, code in doc_mentions:
        for match in IMPORT_AS.finditer(code.split("#", 1)[0]):
            found.append((line, match.group("alias"), match.group("module")))
    return found


def bound_module(bindings, alias, line):
    """The module ``alias`` names at ``line``: the last binding above it, else the doc's first."""
    mine = [(at, module) for at, name, module in bindings if name == alias]
    above = [module for at, module in mine if at <= line]
    if above:
        return above[-1]
    return mine[0][1] if mine else None


def unresolved_names(doc):
    """[(line, name)] of the EDDIS names in ``doc`` that do not exist."""
    doc_mentions = mentions(doc)
    bindings = bindings_in(doc_mentions)
    missing = []
    for line, code in doc_mentions:
        code_only = code.split("#", 1)[0]
        if IMPORT_FROM.match(code_only):
            statement = IMPORT_FROM.match(code_only)
            if statement.group("module").split(".")[0] == "eddis":
                for name in re.split(r"[\s,()]+", statement.group("names").strip()):
                    if name and lookup(statement.group("module"), [name]) is None:
                        missing.append((line, f"{statement.group('module')}.{name}"))
            continue
        if IMPORT_PLAIN.match(code_only) or IMPORT_AS.search(code_only):
            for module in re.findall(r"\bimport\s+([\w.]+)", code_only):
                if module.split(".")[0] == "eddis" and not is_module(module):
                    missing.append((line, module))
            code = IMPORT_AS.sub("", code)
        for match in DOTTED.finditer(STRING.sub('""', code)):
            name = match.group("name")
            head, *attrs = name.split(".")
            module = bound_module(bindings, head, line)
            if module is None and head != "eddis":
                continue  # not an EDDIS name (torch.optim, tf.data, np.float32, ...)
            if module is not None and module.split(".")[0] != "eddis":
                continue  # bound to Horovod or another package
            if head == "eddis" and is_module(name):
                continue
            if module is not None:
                # `import eddis.torch as eddis` above does not make `eddis.errors.X` wrong
                candidates = [module, "eddis"] if head == "eddis" else [module]
            else:
                candidates = ["eddis", *ADAPTERS]
            if all(lookup(candidate, attrs) is None for candidate in candidates):
                missing.append((line, name))
    return missing


def unresolved_horovod_names(doc):
    """[(line, name)] of the names listed after "The names mean the same:" (Horovod's API, bare:
    `init`, `DistributedOptimizer(optimizer, ...)`, `callbacks.MetricAverageCallback`) that the
    module ``hvd`` is bound to lacks; `optimizer.` names are methods, not module names."""
    doc_mentions = mentions(doc)
    bindings = bindings_in(doc_mentions)
    missing = []
    lines = doc.read_text().splitlines()
    for start, text in enumerate(lines, 1):
        if not text.startswith("The names mean the same:"):
            continue
        module = bound_module(bindings, "hvd", start)
        assert module is not None, f"{doc.name}:{start} lists Horovod's names, but nothing binds hvd"
        line = start
        while line <= len(lines) and lines[line - 1].strip():
            for span in INLINE.finditer(lines[line - 1]):
                name = re.match(r"[A-Za-z_][\w.]*", span.group("code"))
                if name and not name.group(0).startswith("optimizer."):
                    if lookup(module, name.group(0).rstrip(".").split(".")) is None:
                        missing.append((line, name.group(0)))
            line += 1
    return missing


@pytest.mark.parametrize("doc", DOCS, ids=lambda doc: doc.name)
def test_every_eddis_name_in_the_manual_exists(doc):
    missing = unresolved_names(doc) + unresolved_horovod_names(doc)
    assert not missing, f"{doc.relative_to(REPO)} names what EDDIS does not have:\n" + "\n".join(
        f"  line {line}: {name}" for line, name in missing)


def test_the_name_check_catches_a_name_the_adapter_lacks(tmp_path):
    # the bug of issue 18: eddis.core is no attribute of eddis.torch
    manual = tmp_path / "manual.md"
    manual.write_text("```python\nimport eddis.torch as eddis\n```\n\n"
                      "Give rank r `eddis.core.no_such_function(64, weights)[r]` samples;\n"
                      "`eddis.core.hetero.easgd` is a module, `eddis.allreduce` a function.\n\n"
                      "| Horovod | EDDIS |\n|---|---|\n| `eddis.elastic` | not available, `eddis.nope` |\n")
    assert unresolved_names(manual) == [(5, "eddis.core.no_such_function"), (10, "eddis.nope")]


def test_the_name_check_catches_a_missing_horovod_name(tmp_path):
    manual = tmp_path / "manual.md"
    manual.write_text("```python\nimport eddis.torch as hvd\n```\n\n"
                      "The names mean the same: `init`, `DistributedOptimizer(optimizer, op=)`,\n"
                      "`Compression.fp16`, `optimizer.synchronize()`, `elastic.no_such_call`.\n")
    assert unresolved_horovod_names(manual) == [(6, "elastic.no_such_call")]


# Horovod's public API, typed out from Horovod 0.28.1's horovod/torch/__init__.py,
# horovod/tensorflow/__init__.py, horovod/tensorflow/keras/__init__.py and the elastic and
# callbacks modules they export (none of them has an __all__ but torch.elastic). Left out:
# what those files import for their own use (check_extension, gpu_available, split_list,
# handle_average_backwards_compatibility, check_num_rank_power_of_2, vars_to_refs,
# refs_to_vars, LocalGradientAggregationHelper, is_version_greater_equal_than), modules
# (os, tf, keras, version, warnings, inspect) and underscore names.
HOROVOD_COMMON = """
    init shutdown is_initialized start_timeline stop_timeline size local_size cross_size rank local_rank cross_rank
    mpi_threads_supported mpi_enabled mpi_built gloo_enabled gloo_built nccl_built ddl_built ccl_built cuda_built
    rocm_built ProcessSet global_process_set add_process_set remove_process_set Average Sum Compression
    Compression.none Compression.fp16 elastic DistributedOptimizer allreduce allgather broadcast
    """.split()
HOROVOD_API = {
    "eddis.torch": HOROVOD_COMMON + """
        Adasum Min Max Product allgather_object broadcast_object broadcast_optimizer_state broadcast_parameters
        allreduce_async allreduce_ allreduce_async_ grouped_allreduce grouped_allreduce_async grouped_allreduce_
        grouped_allreduce_async_ sparse_allreduce_async allgather_async grouped_allgather grouped_allgather_async
        broadcast_async broadcast_ broadcast_async_ alltoall alltoall_async reducescatter reducescatter_async
        grouped_reducescatter grouped_reducescatter_async join barrier poll synchronize HorovodInternalError
        SyncBatchNorm elastic.run elastic.TorchState elastic.ElasticSampler
        """.split(),
    "eddis.tensorflow": HOROVOD_COMMON + """
        Adasum Min Max Product allgather_object broadcast_object broadcast_object_fn broadcast_variables
        grouped_allgather broadcast_ alltoall is_homogeneous rank_op local_rank_op size_op local_size_op
        process_set_included_op join SyncBatchNormalization reducescatter grouped_allreduce grouped_reducescatter
        broadcast_global_variables BroadcastGlobalVariablesHook DistributedGradientTape
        PartialDistributedGradientTape elastic.run elastic.TensorFlowKerasState elastic.TensorFlowState
        elastic.ObjectState
        """.split(),
    "eddis.tensorflow.keras": HOROVOD_COMMON + """
        broadcast_global_variables reducescatter load_model callbacks callbacks.BroadcastGlobalVariablesCallback
        callbacks.MetricAverageCallback callbacks.LearningRateScheduleCallback callbacks.LearningRateWarmupCallback
        callbacks.BestModelCheckpoint elastic.run elastic.TensorFlowKerasState elastic.KerasState
        elastic.CommitStateCallback elastic.UpdateBatchStateCallback elastic.UpdateEpochStateCallback
        """.split(),
}
CONVERSION_MANUAL = {"eddis.torch": "pytorch-conversion.md", "eddis.tensorflow": "tensorflow-conversion.md",
                     "eddis.tensorflow.keras": "tensorflow-conversion.md"}


def horovod_column_names(doc):
    """The names in the first column of the doc's ``| Horovod |`` tables: every dotted name
    in its code spans, without a leading ``hvd.`` (``hvd.reducescatter(t)``: reducescatter)."""
    prose = dict(parse(doc)[1])
    names = set()
    for line, text in prose.items():
        for span in INLINE.finditer(text):
            if in_horovod_column(prose, line, span):
                names.update(re.sub(r"^hvd\.", "", name) for name in re.findall(r"[A-Za-z_][\w.]*\w", span.group("code")))
    return names


def horovod_names_eddis_lacks(module, names, doc):
    """The Horovod names that ``module`` lacks and the doc's differences table does not name."""
    listed = horovod_column_names(doc)
    return [name for name in names if lookup(module, name.split(".")) is None and name not in listed]


@pytest.mark.parametrize("module", sorted(HOROVOD_API))
def test_every_horovod_name_eddis_lacks_is_in_the_differences_table(module):
    doc = REPO / "docs" / CONVERSION_MANUAL[module]
    missing = horovod_names_eddis_lacks(module, HOROVOD_API[module], doc)
    assert not missing, (f"{module} lacks Horovod's {', '.join(missing)}, and the differences table of "
                         f"docs/{doc.name} does not say what to do instead: add a row for each")


def test_the_table_check_catches_a_horovod_name_in_neither(tmp_path):
    manual = tmp_path / "manual.md"
    manual.write_text("| Horovod | EDDIS |\n|---|---|\n| `hvd.alltoall(tensor)`, `elastic.ElasticSampler` | not provided |\n"
                      "\nProse naming `hvd.reducescatter` is no row.\n")
    assert horovod_column_names(manual) == {"alltoall", "tensor", "elastic.ElasticSampler"}
    assert horovod_names_eddis_lacks("eddis.torch", ["alltoall", "reducescatter", "elastic.ElasticSampler",
                                                     "allreduce", "elastic.run"], manual) == ["reducescatter"]


def test_runnable_blocks_are_found():
    blocks = runnable_blocks()
    docs = {block.doc.name for block in blocks}
    assert {"pytorch-conversion.md", "tensorflow-conversion.md"} <= docs, blocks
    assert any(block.ranks > 1 for block in blocks), blocks


def _run_block(block, tmp_path):
    script = tmp_path / f"{block.doc.stem}_line{block.line}.py"
    script.write_text(block.text)
    env = python_env({"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"})
    if block.ranks == 1:
        argv = [PYTHON, str(script)]
    else:
        argv = [PYTHON, "-m", "eddis.launch.train", "--local", "-n", str(block.ranks), str(script)]
    proc = run_process_group(argv, env, BLOCK_TIMEOUT, what=f"the block at {block}", cwd=str(tmp_path))
    assert proc.returncode == 0, (
        f"the runnable block at docs/{block.doc.name} line {block.line} exited with {proc.returncode}\n"
        f"--- stdout ---\n{proc.stdout[-4000:]}\n--- stderr ---\n{proc.stderr[-4000:]}")


def _block_params():
    params = []
    for block in runnable_blocks():
        tier = pytest.mark.mpi if block.ranks > 1 else pytest.mark.slow
        params.append(pytest.param(block, marks=[tier, pytest.mark.timeout(BLOCK_TIMEOUT + 30)], id=repr(block)))
    return params


@pytest.mark.parametrize("block", _block_params())
def test_runnable_block(block, tmp_path):
    _run_block(block, tmp_path)


if __name__ == "__main__":
    for doc in DOCS:
        for line, name in unresolved_names(doc):
            print(f"{doc.relative_to(REPO)}:{line}: {name}")
    print(subprocess.list2cmdline(["runnable:", *map(repr, runnable_blocks())]))
