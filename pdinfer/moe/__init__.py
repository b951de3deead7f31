"""Expert parallelism and EPLB for the mixture-of-experts layers (``layers/moe.py``):

- ``sharding``: the transform that gives each rank its slots of every sparse layer;
- ``placement``: which logical expert each physical slot holds, and replica routing;
- ``dispatch``: the all-to-all dispatch and combine, with buffers sized by the role's workspace;
- ``rebalance``: EPLB's placement algorithm (pure Python);
- ``balancer``: load counting, the role timing of rearrangements, and the weight moves.
"""
