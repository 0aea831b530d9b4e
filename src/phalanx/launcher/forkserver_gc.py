"""Imported by a fork server alone, before torch: the server imports with the cyclic garbage collector off.

The server only imports and forks, so it makes no garbage worth collecting, while the collector, set off
by the imports' allocations, walked their objects again and again (about a tenth of the server's import
time). Every process forked from it freezes those objects and turns the collector on first thing
(:func:`phalanx.launcher.startup.resume_collector`; the module docstring there says why).
"""

import gc

gc.disable()
