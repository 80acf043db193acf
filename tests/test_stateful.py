"""The one stateful harness, run on the model's correct policies (oracle: what each claims).

Configurations with one full-attention group and with full + sliding-window groups are
drawn; the invariant catalogue is checked after every step; rare paths are shown in
``--hypothesis-show-statistics``.
"""

from kvspec.harness import make_state_machine
from kvspec.model import make_scheduler

TestBaseline = make_state_machine(make_scheduler, policy="baseline").TestCase
TestRepair = make_state_machine(make_scheduler, policy="repair").TestCase
