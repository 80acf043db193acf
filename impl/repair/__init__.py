"""``repair`` on the tensor scheduler: kvspec's exact records of what the CPU lost.

Same rules as the model's policy (R1-R9 in ``kvspec.model.repair``), in pieces:

* ``index``: the loss-record index (owners, lost records, retired keys), by key id;
* ``in_flight``: the keys being stored, one dict and one tensor kept in step;
* ``ownership``: what a request owns, and which keys are live or covered;
* ``holds``: the CPU entries pinned until the step ends;
* ``scan``: what each request of a batch decides, from one gather of facts;
* ``commit``: how much of a scanned batch to commit, and applying it;
* ``victims``: where re-stores go;
* ``policy``: ``RepairPolicy``, which ties them together.
"""

from kvspec.impl.repair.policy import RepairPolicy

__all__ = ["RepairPolicy"]
