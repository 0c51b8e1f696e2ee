"""deltarl rollout: engines (``deltarl.rollout.engines``) and the weight sync
(``deltarl.rollout.weights``); see docs/rollout.md."""
