"""Layout, sharding and headroom rules that stages 2 and 4 share."""
