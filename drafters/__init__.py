"""Built-in drafters. Importing this package (entry point group ``specflow.components``) registers them."""

from drafters import ngram  # noqa: F401
from drafters import combinators  # noqa: F401
from drafters import draft_model  # noqa: F401
from drafters import eagle  # noqa: F401
from drafters import eagle3  # noqa: F401
from drafters import medusa  # noqa: F401
