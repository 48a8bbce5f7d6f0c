"""Built-in tree builders; importing the package registers every one in TREE_BUILDERS."""

from trees import bfs, chain, eagle2, static  # noqa: F401  (registration side effects)
