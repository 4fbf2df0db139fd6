"""The images stage: GB10 runtime images and the local simulator, keyed, reproducible, pushed.

It publishes a PublishedImage (engine/published.py); dodo.py hands it on.
"""

from pipelines.stages.images.inputs import git_revision
from pipelines.stages.images.tasks import Images

__all__ = ["Images", "git_revision"]
