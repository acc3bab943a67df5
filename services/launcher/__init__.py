"""`etude run`: the local launcher. Starts Redis (if none answers), prepares the
file:// object store, creates the model if absent, starts the five services as
processes, waits for readiness, shows their status, and stops everything by PID.
"""
