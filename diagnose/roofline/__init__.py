"""How far the step is from what the device can do: the work a step does (FLOPs and bytes, from
the ops' recorded shapes), the device's peak (measured here, and the vendor's dense spec where the
device is known), and the utilisation those give (MFU, time at peak)."""
