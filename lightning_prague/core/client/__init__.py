"""Each training process's client of the control plane: runs in every training process.

* `link` - `MessageLink`, the one TCP connection to the plane and the thread that reads it;
* `control` - `ControlClient` (the process's requests) and `Session` (one fit's view of the plane:
  meetings, flags raised by departures and stops, the work queue's counters);
* `beacon` - `Beacon`, the thread that tells the plane how far training has come;
* `partition` - what a process does when it is cut off from the plane (drop its peers, end).

It imports only the wire contract (`lightning_prague.core.protocol`) and the errors.
"""
