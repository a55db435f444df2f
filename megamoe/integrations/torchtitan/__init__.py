"""megamoe in torchtitan 0.3.0 (extra ``megamoe[torchtitan]``; docs/torchtitan.md).

Through torchtitan's override mechanism, no edit of torchtitan or of a model's config registry::

    python -m torchtitan.train --module qwen3 --config qwen3_moe_debug --override.imports \\
      'megamoe.integrations.torchtitan.overrides.megamoe_routed_experts={"backend":"auto"}'

:mod:`.overrides` holds the factories (``megamoe_routed_experts``, ``megamoe_moe``,
``megamoe_selective_ac``); :class:`MegaMoERoutedExperts` (routed experts),
:class:`MegaMoEMoE` (routed + shared experts) and :class:`MegaMoESelectiveAC` are the modules
and the policy they put in place.
"""

from .ac import MegaMoESelectiveAC, megamoe_save_ops
from .experts import OPTION_FIELDS, MegaMoERoutedExperts
from .moe import MegaMoEMoE

__all__ = [
    "MegaMoERoutedExperts",
    "MegaMoEMoE",
    "MegaMoESelectiveAC",
    "megamoe_save_ops",
    "OPTION_FIELDS",
]
