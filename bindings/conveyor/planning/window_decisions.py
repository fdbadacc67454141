"""What a re-planning window's decision (the Replanner's, as replanning.py hears it) asks of
the windows after it (docs/design.md, "Re-planning")."""
from __future__ import annotations

WINDOW = 5  # steps of a running plan's first window (its census), and the fewest of any window

# A window that confirms a switch saving at least CLEAR_GAIN times the gain asked is
# CLEAR_CONFIRMING steps: the further a saving stands above the noise, the fewer steps show
# that it lasts. At five, GPT-2's hog at step 20 (a 30% saving) was switched from at step 32,
# and a run that ended at step 40 spent its steady half still waiting; a saving near the
# gain asked is still confirmed over WINDOW steps.
CLEAR_GAIN = 2.0
CLEAR_CONFIRMING = 3


def confirming_steps(decision: dict) -> int:
    """The steps of the window after `decision`, which takes a census it owes or confirms the
    switch it found: CLEAR_CONFIRMING where it found one clear of the noise, else WINDOW."""
    clear = decision["confirmations"] > 0 and not decision["switch"] and not decision.get("census_owed") and \
        decision["gain_s"] >= CLEAR_GAIN * decision["gain_asked"] * decision["measured_step_s"]
    return CLEAR_CONFIRMING if clear else WINDOW


def is_census(decision: dict) -> bool:
    """Whether `decision` evaluated a census: every device probed (device_probe.py)."""
    rates = decision.get("probe_rate") or []
    return len(rates) > 1 and min(rates) > 0


def idle_devices(document: dict) -> list[int]:
    """The devices of a plan document that none of its stages' replicas runs on."""
    used = {s["first_device"] + i for s in document["stages"] for i in range(int(s["replicas"]))}
    return [d for d in range(len(document["devices"])) if d not in used]


def superseding(earlier: dict, own: dict) -> dict:
    """`own`, a window's decision heard at its own boundary in place of `earlier` (the window
    before's, evaluated meanwhile and never heard): with the census `earlier` owed, which the
    Replanner owes once and does not ask again. Dropped with it, a BERT's census owed at step
    23 was taken only when the Replanner gave up waiting for it, three windows later, and its
    straggler was switched from at step 42."""
    if earlier.get("census_owed") and not own.get("census_owed"):
        return dict(own, census_owed=True, census_why=earlier.get("census_why", ""))
    return own
