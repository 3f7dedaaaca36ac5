"""The data plane: group communication on the library's process group, in every training process.

* `groups` - `GroupComm`: sums among the members of one group on one process group built at setup
  (no communicator per group), all-or-nothing when a member is lost;
* `collectives` - `MemberCollectives`: Lightning's collectives over the live members;
* `averaging` - averages of models and optimizer states over a group, in flat buffers;
* `norms` - norms and completeness checks in bounded chunks;
* `streams` - `CommStream`: the communication thread's CUDA stream and the hand-over of tensors.
"""
