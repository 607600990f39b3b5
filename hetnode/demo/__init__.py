"""`hetnode demo`: a whole swarm on this machine (coordinator, anchors, a chain of edge peers), watched live
and summed up in a report with plots."""
