"""The node agent: runs ON a node (`python -m torchherd.agent probe|run`).

It imports only the standard library at start, so a probe is fast and works where torch is
missing; torch is imported by the torchrun wrapper it starts, never by the agent itself.
"""
