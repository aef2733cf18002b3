"""The dual-stream races of dev/shimdev/beds/stream_races.py in one release process
(``stream_races.probe``): every target imported first, then the races run."""
import npu_shim
from shimdev.beds import demo_features, stream_races
from shimdev.programs import emit

demo_features.import_targets()  # before anything else imports sglang
emit({"state": npu_shim.states()["dual_stream_experts"]["state"], "races": stream_races.run()})
