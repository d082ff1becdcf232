//! The deploy artefacts run as written: the exact command lines of the Kubernetes manifests
//! (`deploy/k8s`) and of the systemd units (`deploy/systemd`) start a head and two nodes, each
//! in its own network namespace with its own address, and the manifests' training Job submits
//! GRPO to them.
//!
//! What stands in for Kubernetes, and nothing else: `$(VAR)` in commands is expanded from the
//! container's env (downward-API `status.podIP` / `metadata.name`, the Secret's `token`), the
//! image's paths map to directories of this test (`/var/lib/rtrun` per pod, the Secret's mount,
//! `/opt/rtrun/examples` from `deploy/examples`, `/usr/local/bin/train` this build's `train`),
//! cluster DNS is a hosts file per namespace, and — the one change to a command — the joins get
//! `--num-gpus 2` (fake GPUs: this machine has none, the Job's placement needs two per node).
//! The Job also gets `--set` overrides for a short run.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use serde_json::Value;

/// The repository root.
fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Every object of a multi-document manifest.
fn objects(file: &str) -> Vec<Value> {
    let text = std::fs::read_to_string(repo().join("deploy/k8s").join(file)).unwrap();
    serde_saphyr::from_multiple(&text).unwrap_or_else(|e| panic!("{file}: {e}"))
}

/// The object of `kind` named `name` in `file`.
fn object(file: &str, kind: &str, name: &str) -> Value {
    objects(file)
        .into_iter()
        .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("{file} has no {kind} {name}"))
}

/// A string list (a command).
fn strings(value: &Value) -> Vec<String> {
    value.as_array().unwrap().iter().map(|v| v.as_str().unwrap().to_owned()).collect()
}

/// One pod as this test runs it: its namespace, its root for the image's writable paths, its
/// environment.
struct Pod {
    ns: String,
    root: PathBuf,
    env: BTreeMap<String, String>,
    /// A host name of its own (a UTS namespace), as a machine of its own has.
    hostname: Option<String>,
}

/// Paths of the image and their stand-ins.
struct Image {
    /// The Secret's files (`rtrun credentials init`, mode 0440 as mounted).
    secret: PathBuf,
    /// `deploy/examples` as the image holds it (paths inside rewritten to this copy).
    examples: PathBuf,
    /// The directory of `rtrun` (first on PATH) and its path.
    rtrun: PathBuf,
}

impl Image {
    /// A path or argument of the image, mapped for `pod`.
    fn map(&self, pod: &Pod, arg: &str) -> String {
        arg.replace("/var/lib/rtrun", &pod.root.join("var/lib/rtrun").display().to_string())
            .replace("/etc/rtrun/secret", &self.secret.display().to_string())
            .replace("/opt/rtrun/examples", &self.examples.display().to_string())
            .replace("/usr/local/bin/train", env!("CARGO_BIN_EXE_train"))
            .replace("/usr/local/bin/rtrun", &self.rtrun.display().to_string())
    }

    /// `command` (a container's, with `$(VAR)` expanded from the pod's env) as a process in the
    /// pod's namespace, started in its working directory with its environment.
    fn command(&self, pod: &Pod, command: &[String]) -> Command {
        let mut args: Vec<String> = command
            .iter()
            .map(|arg| {
                let mut arg = arg.clone();
                for (key, value) in &pod.env {
                    arg = arg.replace(&format!("$({key})"), value);
                }
                self.map(pod, &arg)
            })
            .collect();
        if args[0] == "rtrun" {
            args[0] = self.rtrun.display().to_string();
        }
        let home = pod.root.join("var/lib/rtrun");
        std::fs::create_dir_all(&home).unwrap();
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &pod.ns]);
        if let Some(hostname) = &pod.hostname {
            cmd.args(["unshare", "--uts", "sh", "-c", "hostname \"$0\" && exec \"$@\"", hostname]);
        }
        cmd.args(&args).current_dir(&home);
        let path = format!(
            "{}:{}",
            self.rtrun.parent().unwrap().display(),
            std::env::var("PATH").unwrap_or_default()
        );
        cmd.env("PATH", path).env("HOME", &home);
        for (key, value) in &pod.env {
            cmd.env(key, self.map(pod, value));
        }
        cmd
    }
}

/// The container's environment as the kubelet gives it.
fn container_env(container: &Value, ip: &str, name: &str, token: &str) -> BTreeMap<String, String> {
    let mut env = BTreeMap::new();
    for var in container["env"].as_array().into_iter().flatten() {
        let key = var["name"].as_str().unwrap().to_owned();
        let value = if let Some(value) = var["value"].as_str() {
            value.to_owned()
        } else if let Some(field) = var["valueFrom"]["fieldRef"]["fieldPath"].as_str() {
            match field {
                "status.podIP" => ip.to_owned(),
                "metadata.name" => name.to_owned(),
                other => panic!("no stand-in for field {other}"),
            }
        } else if var["valueFrom"]["secretKeyRef"]["key"] == "token" {
            token.to_owned()
        } else {
            panic!("no stand-in for env {var}")
        };
        env.insert(key, value);
    }
    env
}

/// Mounts `container`'s persistent volume claims for a pod rooted at `root`: each claim is
/// one directory of this test (`dir/pvc-NAME`), linked at the mount path in every pod that
/// mounts it, as a ReadWriteMany volume is.
fn mount_claims(pod_spec: &Value, container: &Value, root: &Path, dir: &Path) {
    for mount in container["volumeMounts"].as_array().into_iter().flatten() {
        let volume = pod_spec["volumes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|v| v["name"] == mount["name"])
            .unwrap();
        let Some(claim) = volume["persistentVolumeClaim"]["claimName"].as_str() else {
            continue;
        };
        let shared = dir.join(format!("pvc-{claim}"));
        std::fs::create_dir_all(&shared).unwrap();
        let at = root.join(mount["mountPath"].as_str().unwrap().trim_start_matches('/'));
        std::fs::create_dir_all(at.parent().unwrap()).unwrap();
        std::os::unix::fs::symlink(&shared, &at).unwrap();
    }
}

/// Runs `cmd` (a readiness probe) until it succeeds, or fails the test after `timeout`.
fn wait_ready(image: &Image, pod: &Pod, probe: &[String], what: &str, timeout: Duration) {
    let deadline = Instant::now() + timeout;
    loop {
        let out = image.command(pod, probe).output().unwrap();
        if out.status.success() {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{what} not ready: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        std::thread::sleep(Duration::from_millis(300));
    }
}

/// Kills the processes on drop.
struct Processes(Vec<Child>);

impl Drop for Processes {
    fn drop(&mut self) {
        for child in &mut self.0 {
            for pid in rtrun_tests::descendants(child.id()) {
                rtrun_tests::kill9(pid);
            }
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// A daemon's output to a file (a pipe nobody reads could fill and block it).
fn logged(mut cmd: Command, log: &Path) -> Child {
    let file = std::fs::File::create(log).unwrap();
    cmd.stdout(file.try_clone().unwrap()).stderr(file).spawn().unwrap()
}

#[test]
fn the_manifests_and_units_start_a_cluster_in_network_namespaces_and_the_job_trains_on_it() {
    let Some((namespaces, ns, ips)) = rtrun_tests::cluster::namespaces(4) else {
        eprintln!("skipped: network namespaces cannot be created here (needs root and ip netns)");
        return;
    };
    let dir = std::env::temp_dir().join(format!("rtrun-deploy-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let rtrun = rtrun_tests::rtrun_binary();

    // The Secret, as `deploy/README.md` makes it: `rtrun credentials init`, mounted 0440.
    let secret = dir.join("secret");
    let out = Command::new(&rtrun)
        .args(["credentials", "init"])
        .arg(&secret)
        .args(["--node-name", "rtrun-head"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let token = std::fs::read_to_string(secret.join("token")).unwrap().trim().to_owned();
    use std::os::unix::fs::PermissionsExt;
    for entry in std::fs::read_dir(&secret).unwrap() {
        let path = entry.unwrap().path();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o440)).unwrap();
    }
    // The image's examples, with the image's paths.
    let examples = dir.join("image/opt/rtrun/examples");
    copy_examples(&repo().join("deploy/examples"), &examples);
    let image = Image { secret, examples, rtrun: rtrun.clone() };

    // Cluster DNS: the head's stable name.
    for n in &ns {
        namespaces.hosts(n, &[(&ips[0], "rtrun-head-0.rtrun-head")]);
    }

    // The head: its init container, then its container, until its readiness probe passes.
    let head_set = object("head.yaml", "StatefulSet", "rtrun-head");
    let spec = &head_set["spec"]["template"]["spec"];
    let init = &spec["initContainers"][0];
    let container = &spec["containers"][0];
    let head = Pod {
        ns: ns[0].clone(),
        root: dir.join("rtrun-head-0"),
        env: BTreeMap::new(),
        hostname: None,
    };
    mount_claims(spec, container, &head.root, &dir);
    let out = image.command(&head, &strings(&init["command"])).output().unwrap();
    assert!(out.status.success(), "init container: {}", String::from_utf8_lossy(&out.stderr));
    let head = Pod { env: container_env(container, &ips[0], "rtrun-head-0", &token), ..head };
    let mut processes = Processes(Vec::new());
    processes
        .0
        .push(logged(image.command(&head, &strings(&container["command"])), &dir.join("head.log")));
    let probe = strings(&container["readinessProbe"]["exec"]["command"]);
    wait_ready(&image, &head, &probe, "the head", Duration::from_secs(60));

    // Two workers; each ready when `rtrun status --node $POD_NAME` says it joined.
    let workers = object("workers.yaml", "StatefulSet", "rtrun-worker");
    let worker_spec = &workers["spec"]["template"]["spec"];
    let container = &worker_spec["containers"][0];
    assert_eq!(workers["spec"]["replicas"], 2);
    let mut worker_pods = Vec::new();
    for i in 0..2 {
        let name = format!("rtrun-worker-{i}");
        let pod = Pod {
            ns: ns[i + 1].clone(),
            root: dir.join(&name),
            env: container_env(container, &ips[i + 1], &name, &token),
            hostname: None,
        };
        mount_claims(worker_spec, container, &pod.root, &dir);
        let mut command = strings(&container["command"]);
        command.extend(["--num-gpus".to_owned(), "2".to_owned()]);
        processes.0.push(logged(image.command(&pod, &command), &dir.join(format!("{name}.log"))));
        worker_pods.push(pod);
    }
    let probe = strings(&container["readinessProbe"]["exec"]["command"]);
    for pod in &worker_pods {
        wait_ready(&image, pod, &probe, &pod.ns, Duration::from_secs(60));
    }

    // The training Job, from a fourth namespace with only the token.
    let job = object("train-job.yaml", "Job", "rtrun-train");
    let container = &job["spec"]["template"]["spec"]["containers"][0];
    let submitter = Pod {
        ns: ns[3].clone(),
        root: dir.join("rtrun-train"),
        env: container_env(container, &ips[3], "rtrun-train-x", &token),
        hostname: None,
    };
    // The head's and the nodes' metrics ports answer from another pod (what Prometheus,
    // deploy/prometheus/prometheus.yml, scrapes).
    for (ip, metric) in [(&ips[0], "rtrun_nodes"), (&ips[1], "rtrun_"), (&ips[2], "rtrun_")] {
        let url = format!("http://{ip}:8080/metrics");
        let out = image
            .command(&submitter, &strings(&serde_json::json!(["curl", "-sf", url])))
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success() && text.contains(metric), "{url}: {text}");
    }
    let mut command = strings(&container["command"]);
    for set in ["train.max_steps=6", "warmup.steps=20", "data.synthetic.eval_size=16"] {
        command.extend(["--set".to_owned(), set.to_owned()]);
    }
    let started = Instant::now();
    let out = image.command(&submitter, &command).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let logs = || {
        ["head", "rtrun-worker-0", "rtrun-worker-1"]
            .iter()
            .map(|n| {
                format!(
                    "--- {n}:\n{}",
                    std::fs::read_to_string(dir.join(format!("{n}.log"))).unwrap_or_default()
                )
            })
            .collect::<String>()
    };
    assert!(out.status.success(), "the Job failed:\n{stdout}\n{stderr}\n{}", logs());
    eprintln!("the Job's run took {:?}", started.elapsed());
    // The roles went where the placement says: the policy's ranks on one worker, the engines
    // on the other, so weights crossed nodes every step.
    let node_of = |role: &str| -> Vec<String> {
        let line = stdout
            .lines()
            .find(|l| l.trim_start().starts_with(&format!("{role}: ")))
            .unwrap_or_else(|| panic!("no placement line for {role} in\n{stdout}"));
        line.split(" → ").skip(1).map(|p| p.split(" GPU").next().unwrap().to_owned()).collect()
    };
    let (actor, engines) = (node_of("actor"), node_of("vllm_engine"));
    assert_eq!(actor.len(), 2, "{actor:?}");
    assert!(actor.iter().all(|n| *n == actor[0]) && actor[0].starts_with("rtrun-worker-"));
    assert!(engines.iter().all(|n| n != &actor[0] && n.starts_with("rtrun-worker-")));
    let run = dir.join("pvc-rtrun-runs/grpo-cluster");
    let metrics = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
    // The held-out evaluation before RL (step 0), then the six steps, the last evaluated.
    assert_eq!(metrics.lines().count(), 7, "{metrics}");
    let last = metrics.lines().last().unwrap();
    assert!(last.contains("\"step\":6") && last.contains("eval/reward"), "{last}");

    // The systemd units' command lines make the same cluster shape: the head from its unit,
    // the nodes from theirs with the env file's variables (their values for these machines).
    drop(processes);
    let units = |unit: &str| {
        let text = std::fs::read_to_string(repo().join("deploy/systemd").join(unit)).unwrap();
        text.lines().find_map(|l| l.strip_prefix("ExecStart=")).unwrap().to_owned()
    };
    let expand = |line: &str, vars: &[(&str, &str)]| -> Vec<String> {
        let mut line = line.to_owned();
        for (key, value) in vars {
            line = line.replace(&format!("${{{key}}}"), value);
        }
        assert!(!line.contains("${"), "an unset variable in `{line}`");
        line.split_whitespace().map(str::to_owned).collect()
    };
    let env_file = std::fs::read_to_string(repo().join("deploy/systemd/rtrun.env")).unwrap();
    for key in ["RTRUN_ADVERTISE", "RTRUN_HEAD", "RTRUN_BIND_IP", "RTRUN_TOKEN"] {
        assert!(env_file.lines().any(|l| l.starts_with(&format!("{key}="))), "{key} in rtrun.env");
    }
    let mut processes = Processes(Vec::new());
    let host = |i: usize| Pod {
        ns: ns[i].clone(),
        root: dir.join(format!("host-{i}")),
        env: BTreeMap::new(),
        hostname: Some(format!("host-{i}")),
    };
    let head_host = host(0);
    let head_address = format!("{}:6379", ips[0]);
    let command = expand(&units("rtrun-head.service"), &[("RTRUN_ADVERTISE", &ips[0])]);
    processes.0.push(logged(image.command(&head_host, &command), &dir.join("unit-head.log")));
    let status = vec![
        "rtrun".to_owned(),
        "status".to_owned(),
        "--credentials-dir".to_owned(),
        "/var/lib/rtrun/credentials".to_owned(),
        "--address".to_owned(),
        head_address.clone(),
    ];
    wait_ready(&image, &head_host, &status, "the head unit", Duration::from_secs(60));
    let token = std::fs::read_to_string(head_host.root.join("var/lib/rtrun/credentials/token"))
        .unwrap()
        .trim()
        .to_owned();
    for (i, ip) in ips.iter().enumerate().take(3).skip(1) {
        let mut pod = host(i);
        pod.env.insert("RTRUN_TOKEN".into(), token.clone());
        let command = expand(
            &units("rtrun-join.service"),
            &[("RTRUN_HEAD", &head_address), ("RTRUN_BIND_IP", ip)],
        );
        processes
            .0
            .push(logged(image.command(&pod, &command), &dir.join(format!("unit-node-{i}.log"))));
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let out = image.command(&head_host, &status).output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        if text.contains("nodes: 3 alive") {
            break;
        }
        assert!(Instant::now() < deadline, "the units' cluster: {text}");
        std::thread::sleep(Duration::from_millis(300));
    }
    drop(processes);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Copies `deploy/examples` to `to`, rewriting the image's example paths inside the YAML
/// files to `to`.
fn copy_examples(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_examples(&entry.path(), &target);
        } else {
            let text = std::fs::read_to_string(entry.path()).unwrap();
            let root = to.ancestors().find(|p| p.ends_with("examples")).unwrap();
            std::fs::write(
                target,
                text.replace("/opt/rtrun/examples", &root.display().to_string()),
            )
            .unwrap();
        }
    }
}
