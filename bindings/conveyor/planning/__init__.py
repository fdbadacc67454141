"""Everything about plans, in one place:

- profiler.py: measuring a captured graph unit by unit (what the planner is given);
- planner.py: planning it on a cluster (`Plan`, `plan`, plan documents, the parts a Module fixes);
- plan_maker.py: a Module's plans on a call (profile, plan, plans for larger sizes);
- replanning.py: re-planning from the live profile (its messages: replanning_messages.py,
  a window's figures: window_figures.py, its timeline: replanning_trace.py, its probe of a
  device apart from the model: device_probe.py);
- plan_switch.py: moving a running capture to another plan.
"""
from .planner import FixedParts, Plan, cluster_text, plan, read_plan
from .profiler import profile, profile_cache_dir

__all__ = ["Plan", "plan", "read_plan", "cluster_text", "FixedParts", "profile", "profile_cache_dir"]
