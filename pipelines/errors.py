"""The one exception type the pipeline reports as a single line."""


class PipelineError(Exception):
    """A failure with one line a person can act on (file, field, what was expected)."""
