"""Built-in verifiers; importing the package registers every one in VERIFIERS."""

from verifiers import greedy, rejection, threshold, typical  # noqa: F401  (registration side effects)
