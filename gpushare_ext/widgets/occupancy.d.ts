/**
 * Types of occupancy.js for the TypeScript JupyterLab panel (labextension/src/panel.ts),
 * which imports the same view as the notebook widget. Mirrors gpushare_ext/protocol.py's
 * Snapshot in its JSON form (protocol.snapshot_to_builtins).
 */

export interface MigProfile {
  id: number;
  name: string;
  slice_count: number;
  memory_mib: number;
  multiprocessor_count: number;
  instance_count: number;
  memory_slices: number;
  placements: number[];
  media_extensions: boolean;
}

export interface MigInstance {
  uuid: string;
  profile_id: number;
  name: string;
  gpu_instance_id: number;
  compute_instance_id: number;
  memory_mib: number;
  multiprocessor_count: number;
  start: number;
  size: number;
}

export interface DeviceInfo {
  index: number;
  name: string;
  uuid: string;
  memory_total_mib: number;
  multiprocessor_count: number;
  compute_capability: number[];
  driver_version: string;
  mig_enabled: boolean;
  mig_pending: boolean;
  compute_mode: number;
  profiles: MigProfile[];
  instances: MigInstance[];
  simulated: boolean;
}

export interface TimelinePause {
  start: number;
  end?: number | null;
  level: number;
}

export interface TimelineSpan {
  lease_id: string;
  user: string;
  own: boolean;
  priority: number;
  start: number;
  end?: number | null;
  pauses?: TimelinePause[];
  gang?: string;
  rank?: number | null;
}

export interface DeviceView {
  info: DeviceInfo;
  drained: boolean;
  memory_used_mib: number;
  memory_leased_mib: number;
  utilization_pct: number;
  utilization_history: number[];
  holders: string[];
  memory_outside_leases_mib?: Record<string, number>;
  timeline?: TimelineSpan[];
}

export type LeaseState =
  | "queued"
  | "running"
  | "paused"
  | "evicted"
  | "released"
  | "refused"
  | "revoked";

export interface LeaseView {
  lease_id: string;
  user: string;
  own: boolean;
  priority: number;
  state: LeaseState;
  device_index: number | null;
  mig_uuid: string | null;
  memory_bytes: number;
  sm_share: number;
  since_s: number;
  waited_s: number;
  position?: number | null;
  reason?: string;
  label?: string;
  pid?: number | null;
  notebook?: string;
  preemption_level?: number | null;
  estimate_s?: number | null;
  gang?: string;
  rank?: number | null;
}

export interface Snapshot {
  host: string;
  node: string;
  broker_pid: number;
  mode: string;
  inventory: string;
  inventory_description: string;
  time: number;
  you: string;
  is_admin: boolean;
  devices: DeviceView[];
  leases: LeaseView[];
  queue_by_priority: Record<string, number>;
  notes?: string[];
  timeline_window_s?: number;
}

export interface AdminRequest {
  action: "drain" | "undrain" | "cancel";
  device?: number;
  lease_id?: string;
}

export interface RenderOptions {
  onAdmin?: (request: AdminRequest) => void;
  adminHint?: string;
}

/** A request as one row: a lease, or a gang's ranks under the gang's id (groupLeases). */
export interface LeaseRow extends LeaseView {
  ranks: number;
  states: string;
  devices: number[];
}

/** A request on a device's timeline: a lease's span, or a gang's ranks' (groupSpans). */
export interface TimelineRow extends TimelineSpan {
  ranks: number;
}

export const MEMORY_SLICES: number;
export function describePriority(value: number): string;
export function formatDuration(seconds: number): string;
export function formatMiB(mib: number): string;
export function groupLeases(leases: LeaseView[]): LeaseRow[];
export function groupSpans(spans: TimelineSpan[]): TimelineRow[];
export function packedPlacements(profile: MigProfile): number[];
export function statusSummary(snapshot: Snapshot): string;
export function renderMessage(
  root: HTMLElement,
  text: string,
  kind?: "info" | "error",
): void;
export function renderSnapshot(
  root: HTMLElement,
  snapshot: Snapshot,
  options?: RenderOptions,
): void;

declare const _default: {
  render: (context: { model: unknown; el: HTMLElement }) => () => void;
};
export default _default;
