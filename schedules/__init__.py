"""What starts warmups: beat schedules today (``schedules.beat``); pod and worker
watchers and the peak learner next.

Modules here may import ``preheat`` and send ``tasks`` by name; nothing imports them back.
"""
