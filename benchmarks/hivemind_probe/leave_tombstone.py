"""A leave on the DHT: can a member's record be overwritten with a tombstone, or with an earlier expiration?"""
import hivemind
from hivemind.utils.timed_storage import get_dht_time
d = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], nat_port_map=False, auto_nat=False, use_relay=False)
K = "ftis/swarm/members"
now = get_dht_time()
print("store live      ", d.store(K, subkey="m1", value={"step": 3}, expiration_time=now + 10))
print("earlier expiry  ", d.store(K, subkey="m1", value={"left": True}, expiration_time=now + 1),
      "->", d.get(K, latest=True).value["m1"].value)
print("tombstone later ", d.store(K, subkey="m1", value={"left": True}, expiration_time=now + 11),
      "->", d.get(K, latest=True).value["m1"].value)
d.shutdown()
