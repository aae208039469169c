"""The cost model: what a DDP step costs, predicted from measurements, beside the diagnostics.

``alpha_beta.py`` fits a collective's time as α + β·bytes; ``step_profile.py`` records one backward's
ready times; ``simulate.py`` replays that backward with any bucket assignment and one communication
stream; ``auto_bucket.py`` is ``bucket_cap_mb="auto"``: an observer of the engine, like the tracer, that
chooses the cap at the rebuild. The engine never imports this layer: ``auto_bucket`` attaches itself.
"""
