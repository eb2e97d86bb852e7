"""engine/remote/: the device side in worker processes — the worker loop, the process
runners the engine talks to, the plan codec, rank groups and the remote balancer."""
