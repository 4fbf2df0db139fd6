"""The fabric stage: an all-reduce across a ring's members, checked against the profile.

Publishes its results in the store and the bench's gate on them: `fabric_verdict(store,
profile, deployed)` -> (passed, when), `fabric_refusal` -> the one line saying why not.
"""

from pipelines.stages.fabric.records import Verdict, fabric_refusal, fabric_verdict
from pipelines.stages.fabric.settings import FabricSettings
from pipelines.stages.fabric.tasks import Fabric

__all__ = ["Fabric", "FabricSettings", "Verdict", "fabric_refusal", "fabric_verdict"]
