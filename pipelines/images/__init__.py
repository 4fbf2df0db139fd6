"""The images stage: GB10 runtime images and the local simulator, keyed, reproducible, pushed.

Other stages use only what is exported here.
"""

from pipelines.images.inputs import git_revision
from pipelines.images.tasks import Images, PublishedImage

__all__ = ["Images", "PublishedImage", "git_revision"]
