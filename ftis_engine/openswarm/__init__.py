"""The open swarm (issue 44, in progress): members as independent jobs that join, leave and crash without stopping
each other, around a coordinator that keeps the membership (leases) and relays the members' parcels over ZeroMQ.

    wire.py         typed frames with size caps: what goes over the sockets, nothing unpickled
    coordinator.py  `ftis-engine swarm serve`: joins checked against the swarm's shared settings, leases, relay
    coordlog.py     its log read back: what a coordinator restarted on the log of the one before it restores
    client.py       a member's side: join, heartbeats, parcels out and in, rejoin after a coordinator restart

Members only dial out (to the coordinator), so only the coordinator needs a reachable address.
"""
