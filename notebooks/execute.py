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


def execute(source):
    """Run a notebook top to bottom in its own folder. -> the notebook with its outputs and the
    seconds it took (raises nbclient's CellExecutionError, with the cell and its traceback, if a
    cell fails)"""
    import nbclient
    import nbformat
    nb = nbformat.read(source, as_version=4)
    start = time.time()
    nbclient.NotebookClient(nb, timeout=TIMEOUT_S, kernel_name="python3",
                            resources={"metadata": {"path": str(source.parent)}}).execute()
    return nb, time.time() - start


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
        nb, seconds = execute(source)
        print(f"  -> {write(source, nb, seconds).relative_to(HERE.parent)} ({seconds:.0f} s)",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
