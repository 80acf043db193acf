"""Findings people can read: the narrated replay, the timeline picture and the finding page.

``positions`` (what each block position of a request is, from a snapshot), ``events`` (what one
operation did, from the snapshots before and after it), ``narrate`` (the replay told operation by
operation, as data), ``svg`` (SVG text and the position-cell renderer, shared with the SPEC's
pictures), ``timeline`` (the picture of a narrated replay), ``html`` (the self-contained page) and
``browser`` (headless Chromium over the DevTools protocol, to look at a page as a reader would).
"""
