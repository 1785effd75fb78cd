"""The run's own failures, which `run.failure` reports in one line with how to continue."""


class SearcherError(RuntimeError):
    """A searcher failed or died; the message names it and carries its traceback."""


class NonFiniteError(ArithmeticError):
    """The loss or the gradient norm of a step is NaN or infinite; the step was not applied."""
