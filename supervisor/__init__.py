"""From alert to recovery: run a training job, act on its alerts by policy, count the cost.

`trainvitals supervise [--policy FILE] -- <the job's command>` (main.py): launches the job
under torchrun, one agent per node (launch.py), reads the run's alerts from the collector
or is woken by Alertmanager (alerts.py, webhook.py), decides by policy (policy.py,
actions.py), fences nodes (fence.py), rolls checkpoints back and relaunches (agent.py).
"""
