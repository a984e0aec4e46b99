"""Everything one site does alone: its process group, parallel layout, model, data and loop.

``isthmus.intra`` never imports ``isthmus.inter``: a site must be testable without the WAN.
"""
