"""The executed copies of the notebooks: what a reader sees on the web without running anything.

    python notebooks/execute.py            # run every notebook, write notebooks/executed/<name>
    python notebooks/execute.py 02         # only those whose name holds "02"

The sources (notebooks/*.ipynb, notebooks/assignments/*.ipynb) are stored without outputs, so
that their diffs stay readable; each executed copy records the hash of its source's cells
(`source_hash`), and `make test` fails when a source changed after its copy was made
(tests/test_notebooks.py). Each notebook's header states its run time; this writes it, as
measured, into the source and the copy. `make notebooks` runs this.
"""
import hashlib
import json
import os
import platform
import re
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
EXECUTED = HERE / "executed"
TIMEOUT_S = 900                          # per cell
RUN_TIME = re.compile(r"\*\*Run time:\*\*[^\n]*")   # the header line `write` keeps true


def sources():
    """Every notebook a reader is given: the tutorials and the assignments."""
    return sorted(p for p in HERE.rglob("*.ipynb")
                  if not {"executed", ".ipynb_checkpoints"} & set(p.relative_to(HERE).parts))


def executed_path(source):
    """notebooks/02_x.ipynb -> notebooks/executed/02_x.ipynb (assignments/a.ipynb likewise)."""
    return EXECUTED / source.relative_to(HERE)


def source_hash(nb):
    """What a copy must have been made from: every cell's type and text, in order."""
    text = "\x00".join(f"{cell.cell_type}\x01{cell.source}" for cell in nb.cells)
    return hashlib.sha256(text.encode()).hexdigest()


def machine():
    """This machine's CPU, as a run time is reported: "2 CPU cores, AMD EPYC"."""
    model = platform.processor() or "CPU"
    if Path("/proc/cpuinfo").is_file():            # Linux names the model there
        names = [line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                 if line.startswith("model name")]
        model = names[0] if names else model
    return f"{os.cpu_count()} CPU cores, {model}"


# Run in the kernel before the notebook's first cell, and taken out of the copy afterwards: after
# every cell, each plot the cell drew is checked for what a reader needs without the code (axes
# named in words, a title), and what is missing is written to a file. It runs before matplotlib's
# inline backend shows and closes the cell's figures, because it is registered first.
FIGURE_CHECK = """
import json as _json
def _tba_check_figures(path={path!r}):
    import sys
    if "matplotlib.pyplot" not in sys.modules:
        return
    plt = sys.modules["matplotlib.pyplot"]
    missing = []
    for number in plt.get_fignums():
        figure = plt.figure(number)
        suptitle = figure._suptitle.get_text() if figure._suptitle else ""
        for index, ax in enumerate(figure.axes):
            if not ax.get_visible() or not ax.has_data():
                continue
            # a twin (ax.twinx()) shares its panel's x axis and title, and has its own y axis
            panel = [a for a in figure.axes if a.bbox.bounds == ax.bbox.bounds]
            if not any(a.get_xlabel() for a in panel):
                missing.append(f"panel {{index + 1}}: no x-axis label")
            if not ax.get_ylabel():
                missing.append(f"panel {{index + 1}}: no y-axis label")
            if not suptitle and not any(a.get_title() for a in panel):
                missing.append(f"panel {{index + 1}}: no title")
    if missing:
        with open(path, "a") as out:
            out.write(_json.dumps({{"cell": get_ipython().execution_count, "missing": missing}}))
            out.write("\\n")
get_ipython().events.register("post_execute", _tba_check_figures)
"""


def execute(source):
    """Run a notebook top to bottom in its own folder. -> the notebook with its outputs, the
    seconds it took, and the plots that lack an axis label or a title, as "cell N: panel i: no
    x-axis label" (raises nbclient's CellExecutionError, with the cell and its traceback, if a
    cell fails)"""
    import tempfile

    import nbclient
    import nbformat
    nb = nbformat.read(source, as_version=4)
    with tempfile.TemporaryDirectory() as folder:
        report = Path(folder) / "figures.jsonl"
        nb.cells.insert(0, nbformat.v4.new_code_cell(FIGURE_CHECK.format(path=str(report))))
        start = time.time()
        nbclient.NotebookClient(nb, timeout=TIMEOUT_S, kernel_name="python3",
                                resources={"metadata": {"path": str(source.parent)}}).execute()
        seconds = time.time() - start
        nb.cells.pop(0)
        rows = [json.loads(line) for line in report.read_text().splitlines()] \
            if report.is_file() else []
    # IPython has counted the cell by the time the check runs, and the check cell was cell 1:
    # the number the reader sees is two less
    unreadable = [f"cell {row['cell'] - 2}: {what}" for row in rows for what in row["missing"]]
    for cell in nb.cells:
        if cell.cell_type == "code" and cell.execution_count:
            cell.execution_count -= 1
            for output in cell.outputs:
                if "execution_count" in output:
                    output.execution_count -= 1
    return nb, seconds, unreadable


def with_run_time(nb, seconds):
    """The header's `**Run time:**` line set to what this run took (a notebook without one is
    left as it is)."""
    line = (f"**Run time:** about {max(1, round(seconds / 60))} min on {machine()} "
            "(measured by `make notebooks`).")
    for cell in nb.cells:
        if cell.cell_type == "markdown" and RUN_TIME.search(cell.source):
            cell.source = RUN_TIME.sub(line, cell.source)
    return nb


def write(source, nb, seconds):
    """The executed copy, and the source with the run time it measured (outputs still cleared).
    Both carry the same cells, so the copy's `source_hash` is the source's."""
    import nbformat
    plain = with_run_time(nbformat.read(source, as_version=4), seconds)
    nbformat.write(plain, source)
    nb = with_run_time(nb, seconds)
    nb.metadata["tba"] = {"source": source.relative_to(HERE.parent).as_posix(),
                          "source_hash": source_hash(plain), "run_s": round(seconds)}
    path = executed_path(source)
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, path)
    return path


def main(argv):
    chosen = [p for p in sources() if not argv or any(a in p.name for a in argv)]
    if not chosen:
        print(f"error: no notebook matches {' '.join(argv)}: name part of one of "
              f"{', '.join(p.name for p in sources())}", file=sys.stderr)
        return 2
    for source in chosen:
        print(f"{source.relative_to(HERE.parent)} ...", flush=True)
        nb, seconds, unreadable = execute(source)
        if unreadable:
            print(f"error: {source.name} draws plots a reader cannot read without the code: "
                  f"{'; '.join(unreadable)}: name each axis (ax.set(xlabel=..., ylabel=...)) "
                  "and give each panel a title", file=sys.stderr)
            return 1
        print(f"  -> {write(source, nb, seconds).relative_to(HERE.parent)} ({seconds:.0f} s)",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
