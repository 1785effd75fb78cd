"""Graders for the three assignments: the project's own tests, run against a student's function.

    from grader import grade_tb_loss, grade_priority, grade_extractor
    grade_tb_loss(my_tb_loss)        # prints one line per check and the score -> (passed, total)

Each grader loads the project's test module (tests/test_trainer.py, tests/test_buffer.py,
tests/test_tasks.py), puts the student's function where the project's own one would be, runs
the tests that concern it, and adds a few checks of its own. A check passes when it returns;
any exception (a failed assert, NotImplementedError, a wrong shape) fails it.

The reference solutions are the project's code: `trainer.tb_loss`, `draws.priority_weights` and
`tasks.answers.extract_answer`. Each scores full marks; tests/test_notebooks.py checks that, and
that a stub scores less.
"""
import contextlib
import functools
import importlib.util
import sys
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from replay import draws  # noqa: E402
import trainer  # noqa: E402


@functools.cache
def project_tests(name):
    """tests/<name>.py, imported as a module (tests/ is not a package)."""
    spec = importlib.util.spec_from_file_location(f"project_tests.{name}",
                                                  REPO / "tests" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def swapped(namespace, name, value):
    """`namespace[name]` (a module attribute or a dict entry) is `value` inside the block."""
    is_dict = isinstance(namespace, dict)
    old = namespace[name] if is_dict else getattr(namespace, name)
    if is_dict:
        namespace[name] = value
    else:
        setattr(namespace, name, value)
    try:
        yield
    finally:
        if is_dict:
            namespace[name] = old
        else:
            setattr(namespace, name, old)


def where(error, own_checks):
    """The line of the project's test (or, with `own_checks`, of this file) that failed: it
    shows the student what was asked."""
    places = [str(REPO / "tests")] + ([__file__] if own_checks else [])
    frames = [f for f in traceback.extract_tb(error.__traceback__)
              if any(f.filename.startswith(place) for place in places)]
    return f" at `{frames[-1].line}`" if frames and frames[-1].line else ""


def inside_the_project(error):
    """`file.function` of the project's own code (not its tests, not this grader) where `error`
    was raised, if it was: its message would be about the project, not about the student's
    function. -> str, or None"""
    frames = traceback.extract_tb(error.__traceback__)
    last = frames[-1] if frames else None
    if (last is None or not last.filename.startswith(str(REPO)) or last.filename == __file__
            or last.filename.startswith(str(REPO / "tests"))):
        return None
    return f"{Path(last.filename).relative_to(REPO)}: {last.name}"


def run_checks(title, checks):
    """checks: [(name, function of no arguments that raises on failure)]. -> (passed, total)"""
    passed = 0
    print(title)
    for name, check in checks:
        try:
            check()
        except NotImplementedError:
            print(f"  FAIL  {name}: not implemented yet")
        except Exception as e:          # a wrong answer, a wrong shape, a crash: all fail the check
            inside = inside_the_project(e)
            if inside:
                print(f"  FAIL  {name}: the project's {inside} could not use what your function "
                      "returned: check the shapes and types the assignment asks for")
                continue
            message = str(e).strip().splitlines()[0] if str(e).strip() else ""
            print(f"  FAIL  {name}: {type(e).__name__}{where(e, own_checks=not message)}"
                  + (f": {message[:200]}" if message else ""))
        else:
            passed += 1
            print(f"  pass  {name}")
    print(f"score: {passed}/{len(checks)}")
    return passed, len(checks)


# --- (a) the trajectory-balance loss -------------------------------------------------------------

def two_groups(requires_grad=True):
    """Two prompts, K = 3 each, whose log Ẑ differ (1.5 and −1): -> logp, ref_logp, reward, β"""
    logp = torch.tensor([[-1.0, -2.0, -3.0], [-2.0, -1.0, -3.0]], requires_grad=requires_grad)
    ref_logp = torch.tensor([[-1.5, -1.0, -2.0], [-4.0, -2.5, -3.5]])
    reward = torch.tensor([[1.0, 0.0, 0.5], [0.0, 0.5, 0.0]])
    return logp, ref_logp, reward, 0.5


def log_z_mistake(log_z):
    """Words for a wrong log Ẑ [B] of `two_groups`: which slip in δ = log p_θ − log p_ref − r/β
    gives it, if one does."""
    logp, ref_logp, reward, beta = two_groups(requires_grad=False)
    slips = {"the sign of r/β: δ subtracts the reward term, δ = log p_θ − log p_ref − r/β, "
             "so log Ẑ = −mean_k δ_k adds it back": (logp - ref_logp + reward / beta),
             "the reward is not divided by β: the target is p_ref·exp(r/β), so δ takes r/β, "
             "not r": (logp - ref_logp - reward),
             "the sign of log Ẑ: it is minus the mean of δ over the K completions "
             "(log Ẑ + δ_k is then 0 on average)": -(logp - ref_logp - reward / beta)}
    for words, delta in slips.items():
        if torch.allclose(log_z, -delta.mean(1), atol=1e-4):
            return words
    return "log Ẑ(x) = −mean_k δ_k"


def summed_where_averaged(ratio, b=2, k=3):
    """Words for a loss `ratio` times the right one on `two_groups` (B = 2, K = 3), if a sum
    where a mean belongs explains it."""
    sums = {k: f"it sums over the K = {k} completions of each prompt where it should average "
               "(.mean(1), not .sum(1))",
            b: f"it sums over the B = {b} prompts where it should average (.mean(0), not .sum(0))",
            b * k: f"it sums over all B·K = {b * k} squared residuals where it should average "
                   "(.mean(), not .sum())"}
    for times, words in sums.items():
        if abs(ratio - times) < 1e-3:
            return f" ({times} times too large): {words}"
    return ""


def tb_loss_mistakes(fn):
    """The common mistakes, in words, each with the mismatch that shows it, found from what `fn`
    returns on `two_groups`. -> (problems [str], empty: none of them; usable: whether the
    project's training step can take what `fn` returns: a scalar loss, one log Ẑ per prompt)"""
    try:
        out = fn(*two_groups())
    except NotImplementedError:
        return [], True                   # a stub: every check says "not implemented yet"
    except Exception as e:
        return [f"tb_loss raised {type(e).__name__}: {str(e).strip()[:200]}"], False
    if not (isinstance(out, tuple) and len(out) == 2 and all(map(torch.is_tensor, out))):
        return ["return a tuple (loss, log_z) of two tensors"], False
    (loss, log_z), (want_loss, want_log_z) = out, trainer.tb_loss(*two_groups())
    k = 3
    shown = [round(v, 4) for v in log_z.detach().flatten().tolist()]
    want = [round(v, 4) for v in want_log_z.tolist()]
    problems = []
    per_prompt = log_z.shape == want_log_z.shape and len(set(shown)) > 1
    usable = per_prompt and loss.dim() == 0
    if log_z.numel() == 1 or (log_z.shape == want_log_z.shape and not per_prompt):
        problems.append(f"one log Ẑ for the whole batch (got {shown}, want {want}): each prompt x "
                        "has its own normaliser Z(x), so average δ over the K completions of each "
                        "row only (dim=1), one log Ẑ per prompt, shape [B]")
    elif log_z.shape != want_log_z.shape:
        problems.append(f"log_z has shape {list(log_z.shape)}; it should be [B] = [2], one "
                        "estimate per prompt")
    elif not torch.allclose(log_z.detach().float(), want_log_z, atol=1e-4):
        problems.append(f"log_z is {shown}, want {want}: " + log_z_mistake(log_z.detach().float()))
    if loss.dim() != 0:
        problems.append(f"the loss has shape {list(loss.shape)}; it should be a scalar, the mean "
                        "over all B·K squared residuals")
    elif not problems and not torch.isclose(loss.detach(), want_loss, atol=1e-5):
        ratio = (loss.detach() / want_loss).item()
        if abs(ratio - k / (k - 1)) < 1e-3:
            problems.append(f"the loss is K/(K−1) = {k}/{k - 1} times the right one "
                            f"({loss.item():.4f} against {want_loss.item():.4f}): it divides by "
                            "K − 1, as torch.var does by default (the unbiased variance). The loss "
                            "is the mean of the squared residuals: divide by K (.pow(2).mean(), or "
                            "torch.var(..., unbiased=False))")
        else:
            problems.append(f"the loss is {loss.item():.4f}, want {want_loss.item():.4f}"
                            + summed_where_averaged(ratio))
    if log_z.requires_grad:
        problems.append("the log_z you return carries gradient: it is an estimate, not a "
                        "parameter, so return it detached (log_z.detach()); the loss's gradient is "
                        "the same either way, since Σ_k (δ_k − mean δ) = 0")
    elif loss.dim() == 0 and not loss.requires_grad:
        problems.append("the loss carries no gradient to logp: compute it with torch operations "
                        "on logp, without .detach(), .item() or .tolist()")
    return problems, usable


def grade_tb_loss(fn):
    """fn(logp, ref_logp, reward, beta) -> (loss, log_z), with the semantics of trainer.tb_loss.
    First the common mistakes, named; then the project's tests and a few checks of its own. A
    function whose output the project's training step cannot use does not run in it: the
    project's own error would say nothing about the mistake."""
    tests = project_tests("test_trainer")
    from tasks.toy import build_model, build_tokenizer
    tokenizer = build_tokenizer()
    toy = (build_model(len(tokenizer)), tokenizer)      # the tests' `toy` fixture
    problems, usable = tb_loss_mistakes(fn)
    if problems:
        print("What the grader found:")
        for problem in problems:
            print(f"  - {problem}")
        print()

    def project_test(test, *args):
        def check():
            if not usable:
                raise AssertionError("not run: fix what the grader found above first")
            # the student's function replaces the project's in the test module and in the
            # trainer's TB loss (which `train_step` takes by default)
            with swapped(tests, "tb_loss", fn), swapped(trainer, "TB", trainer.Loss(fn)):
                test(*args)
        return check

    def random_groups(requires_grad=False):
        gen = torch.Generator().manual_seed(5)
        logp = (-5 * torch.rand(3, 6, generator=gen)).requires_grad_(requires_grad)    # [B, K]
        return logp, -5 * torch.rand(3, 6, generator=gen), torch.rand(3, 6, generator=gen), 0.3

    def matches_reference():
        loss, log_z = fn(*random_groups())
        ref_loss, ref_log_z = trainer.tb_loss(*random_groups())
        assert tuple(log_z.shape) == (3,), f"log_z should be [B] = [3], got {tuple(log_z.shape)}"
        assert loss.dim() == 0, f"loss should be a scalar, got shape {tuple(loss.shape)}"
        assert torch.allclose(log_z, ref_log_z, atol=1e-5), \
            f"log_z {log_z.tolist()}, want {ref_log_z.tolist()}"
        assert torch.isclose(loss, ref_loss, atol=1e-6), \
            f"loss {loss.item():.6f}, want {ref_loss.item():.6f}"

    def log_z_is_detached():
        logp, ref_logp, reward, beta = random_groups(requires_grad=True)
        loss, log_z = fn(logp, ref_logp, reward, beta)
        assert loss.requires_grad, "the loss must carry the gradient to log p_θ"
        assert not log_z.requires_grad, "log Ẑ is an estimate, not a parameter: detach it"

    def gradient_matches_reference():
        logp, ref_logp, reward, beta = random_groups(requires_grad=True)
        grad, = torch.autograd.grad(fn(logp, ref_logp, reward, beta)[0], logp)
        logp, ref_logp, reward, beta = random_groups(requires_grad=True)
        ref_grad, = torch.autograd.grad(trainer.tb_loss(logp, ref_logp, reward, beta)[0], logp)
        assert torch.allclose(grad, ref_grad, atol=1e-6), \
            f"the gradient in logp differs from the reference's by up to " \
            f"{(grad - ref_grad).abs().max().item():.3g}"

    return run_checks("tb_loss", [
        ("test_tb_loss_by_hand", project_test(tests.test_tb_loss_by_hand)),
        ("test_tb_loss_log_z_per_prompt", project_test(tests.test_tb_loss_log_z_per_prompt)),
        ("test_tb_gradient_equals_reinforce_on_policy",
         project_test(tests.test_tb_gradient_equals_reinforce_on_policy, toy)),
        ("test_micro_batches_give_the_same_step",
         project_test(tests.test_micro_batches_give_the_same_step, toy)),
        ("loss and log Ẑ match the reference on random groups", matches_reference),
        ("log Ẑ carries no gradient", log_z_is_detached),
        ("gradient w.r.t. log p matches the reference", gradient_matches_reference),
    ])


# --- (b) reward-prioritised sampling from the replay buffer ---------------------------------------

def grade_priority(fn):
    """fn(group_reward [n] float64, available [n] bool, priority_temp) -> [n] weights: exp(r/τ)
    up to one common factor on the available groups, 0 on the others, and no overflow or
    all-zero underflow. In four of the checks the project's ReplayBuffer.sample draws with it."""
    tests = project_tests("test_buffer")

    def checked(group_reward, available, priority_temp):
        """`fn` as the buffer calls it, its weights looked at first: weights that are not finite,
        or all 0, are named as such, not as whatever the buffer's draw then does with them."""
        weights = fn(group_reward, available, priority_temp)
        if torch.is_tensor(weights) and weights.shape == available.shape:
            if not torch.isfinite(weights).all():
                raise AssertionError(f"your weights are not finite at τ = {priority_temp} "
                                     f"(e.g. {weights[~torch.isfinite(weights)][0].item()}): "
                                     "exp(r/τ) overflowed; subtract the largest available "
                                     "logit before exp")
            if available.any() and not (weights[available] > 0).any():
                raise AssertionError(f"your weights are all 0 on the available groups at "
                                     f"τ = {priority_temp}: exp(r/τ) underflowed; shift by the "
                                     "largest *available* logit, so that it weighs exactly 1")
        return weights

    def in_the_buffer(check):
        """`check`, run while the project's buffer draws with `fn`."""
        def swapped_check():
            with swapped(draws, "priority_weights", checked):  # what ReplayBuffer.sample calls
                check()
        return swapped_check

    def shape_and_mask():
        reward = torch.tensor([0.1, 0.9, 0.5, 0.3], dtype=torch.float64)
        available = torch.tensor([True, False, True, True])
        weights = fn(reward.clone(), available.clone(), 0.5)
        assert tuple(weights.shape) == (4,), f"weights should be [n] = [4], got {tuple(weights.shape)}"
        assert weights[1] == 0, "a group already drawn (available=False) must weigh 0"
        assert torch.all(weights[available] > 0), "every available group needs a weight > 0"

    def proportional_to_exp_reward():
        gen = torch.Generator().manual_seed(2)
        for temp in (0.05, 0.3, 2.0):
            reward = torch.rand(7, generator=gen, dtype=torch.float64)
            available = torch.rand(7, generator=gen) < 0.7
            available[0] = True
            weights = fn(reward, available, temp)
            exact = torch.softmax(reward[available] / temp, 0)
            torch.testing.assert_close(weights[available] / weights[available].sum(), exact)

    def stable_at_tiny_temperature():
        reward = torch.tensor([5000.0, 4000.0, 3000.0], dtype=torch.float64)
        for available in ([True, True, True], [False, True, True], [False, False, True]):
            weights = fn(reward, torch.tensor(available), 1e-3)
            assert torch.isfinite(weights).all(), f"overflow: {weights.tolist()} (shift the logits)"
            assert weights.sum() > 0, (f"all weights underflowed to 0 with available={available}: "
                                       "shift by the largest *available* logit")

    def leaves_its_inputs_alone():
        reward = torch.tensor([0.2, 0.4], dtype=torch.float64)
        available = torch.tensor([True, True])
        fn(reward, available, 0.1)
        assert reward.tolist() == [0.2, 0.4] and available.tolist() == [True, True], \
            "do not change the buffer's tensors in place"

    def plackett_luce_pairs():
        """Two groups from three prompts: P(i then j) = p_i · p_j / (1 − p_i)."""
        rewards, temp, draws = [0.0, 0.5, 1.0], 0.5, 4000
        buf = tests.filled(3, rewards=rewards)
        p = torch.softmax(torch.tensor(rewards, dtype=torch.float64) / temp, 0)      # [3]
        gen = torch.Generator().manual_seed(4)
        counts = torch.zeros(3, 3, dtype=torch.float64)
        for _ in range(draws):
            i, j = buf.sample(2, recent_frac=0.0, priority_temp=temp, generator=gen).prompt_index
            counts[i - 1, j - 1] += 1      # the buffer's prompts are 1, 2, 3
        exact = p[:, None] * p[None, :] / (1 - p[:, None])                           # [3, 3]
        exact.fill_diagonal_(0.0)
        freq = counts / draws
        tolerance = 4 * (exact * (1 - exact) / draws).sqrt() + 1e-9
        assert torch.all((freq - exact).abs() <= tolerance), f"pair frequencies {freq} vs {exact}"

    return run_checks("priority_weights", [
        ("test_reward_prioritised_sampling", in_the_buffer(tests.test_reward_prioritised_sampling)),
        ("test_priority_numerically_stable", in_the_buffer(tests.test_priority_numerically_stable)),
        ("test_generator_reproducible", in_the_buffer(tests.test_generator_reproducible)),
        ("shape [n]; drawn groups weigh 0", shape_and_mask),
        ("weights ∝ exp(reward / τ) over the available groups", proportional_to_exp_reward),
        ("no overflow, no all-zero underflow at τ = 0.001", stable_at_tiny_temperature),
        ("inputs not changed in place", leaves_its_inputs_alone),
        ("two draws in the buffer: renormalised after the first", in_the_buffer(plackett_luce_pairs)),
    ])


# --- (c) the GSM8K answer extractor ---------------------------------------------------------------

def extract_answer_cases():
    """The (text, answer) table of tests/test_tasks.py::test_extract_answer."""
    test = project_tests("test_tasks").test_extract_answer
    mark = next(m for m in test.pytestmark if m.name == "parametrize")
    return mark.args[1]


# What each case of the table tests, in words: printed beside a failing one.
FAMILIES = [
    ("the marker", ["#### 18", "She makes 9 * 2 = $<<9*2=18>>18 every day.\n#### 18",
                    "The answer is 42.", "the ANSWER is 42", "The final answer is: 7 apples"],
     "the answer follows GSM8K's '####' or 'the answer is' (any case)"),
    ("the last number", ["So 3 + 4 = 7", "Step 1: 2 + 2 = 4."],
     "without a marker the answer is the last number, not the first"),
    ("after the answer", ["#### 18\nThe next question: 99 balloons",
                          "The answer is 80 - 20 = 60. Then 7 more",
                          "The answer is 8. The answer is 9.", "####\n12"],
     "the last marker wins, the answer is the last number of its sentence, and what follows it "
     "does not count (a marker with nothing after it: the last number)"),
    ("thousands", ["It costs $1,000.50 in total.", "#### 1,234,567", "1,0000"],
     "a comma between groups of three digits is a thousands separator, dropped; '1,0000' is no "
     "such group"),
    ("normal form", ["The answer is $10.00.", "That is 10.0", "0.5 of the cake", "Half is .5"],
     "the number as a normal string: no trailing zeros after the point (10.00 -> 10), a leading "
     "0 before it (.5 -> 0.5)"),
    ("units", ["About 50% of them", "The answer is 12 km.", "He walks 5km"],
     "a trailing unit or sign ($, %, km) is not part of the number"),
    ("negative numbers", ["The temperature is -5 degrees.", "#### -3", "He owes (-12) dollars",
                          "x = −4"],
     "a minus sign before a number is kept, a Unicode minus (−) too"),
    ("not a minus", ["Pages 3-4", "5 -3"],
     "a hyphen between two numbers is a range or a subtraction: the second number is positive"),
    ("no number", ["There are no numbers here.", "", "abc123 and 7"],
     "no number gives None, and digits inside a word are not a number"),
]


def family_of(text):
    """The words of the FAMILIES row that holds `text` ('' if none does)."""
    return next((words for _, texts, words in FAMILIES if text in texts), "")


def grade_extractor(fn):
    """fn(text) -> the final answer as a normalised number string, or None."""
    def case(text, answer):
        def check():
            got = fn(text)
            why = family_of(text)
            assert got == answer, f"expected {answer!r}, got {got!r}" + (f" ({why})" if why else "")
        return check

    return run_checks("extract_answer", [(f"{text!r} -> {answer!r}", case(text, answer))
                                         for text, answer in extract_answer_cases()])
