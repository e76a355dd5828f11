"""kvbridge: the KV-cache transfer plane between prefill and decode workers."""

import logging

__version__ = "0.1.0"

# A library logs, its host decides where that goes: one logger per component under
# "kvbridge" (kvbridge.prefill, .decode, .control, .bootstrap), silent unless configured.
logging.getLogger("kvbridge").addHandler(logging.NullHandler())
