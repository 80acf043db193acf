"""The one stateful harness, run on the model's correct policies (oracle: what each claims).

Configurations with one full-attention group and with full + sliding-window groups are
drawn; the invariant catalogue is checked after every step; rare paths are shown in
``--hypothesis-show-statistics``.
"""

from kvspec.drivers.harness import make_state_machine
from kvspec.impl import make_scheduler as make_impl
from kvspec.model import make_scheduler

TestBaseline = make_state_machine(make_scheduler, policy="baseline").TestCase
TestSignalRescan = make_state_machine(make_scheduler, policy="signal-rescan").TestCase
TestRepair = make_state_machine(make_scheduler, policy="repair").TestCase
TestLazyBaseline = make_state_machine(make_scheduler, policy="baseline", lazy=True).TestCase

# The implementation under the same harness, the model as reference: equal snapshots after every step.
TestImplBaseline = make_state_machine(make_impl, reference=make_scheduler, policy="baseline").TestCase
TestImplSignalRescan = make_state_machine(make_impl, reference=make_scheduler, policy="signal-rescan").TestCase
TestImplRepair = make_state_machine(make_impl, reference=make_scheduler, policy="repair").TestCase
TestImplLazy = make_state_machine(make_impl, reference=make_scheduler, policy="baseline", lazy=True).TestCase
