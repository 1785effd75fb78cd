"""The run's own failures, which `run.failure` reports in one line with how to continue."""
from contextlib import contextmanager


class SearcherError(RuntimeError):
    """A searcher failed or died; the message names it and carries its traceback."""


class NonFiniteError(ArithmeticError):
    """The loss or the gradient norm of a step is NaN or infinite; the step was not applied."""


@contextmanager
def diverged_policy_named(version):
    """Sampling from a policy whose weights hold NaN or inf fails in torch.multinomial with a
    traceback about a "probability tensor": say what it means instead (NonFiniteError)."""
    try:
        yield
    except RuntimeError as e:
        if "probability tensor contains" not in str(e):
            raise
        raise NonFiniteError(f"the policy's next-token probabilities are NaN or infinite with "
                             f"the weights of version {version}: the policy has diverged") from e
